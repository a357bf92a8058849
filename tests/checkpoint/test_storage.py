"""Safetensors shard files: exact bytes, streaming writes, verified range reads."""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from netdist.checkpoint.metadata import FileRecord
from netdist.checkpoint.storage import (
    BlockChecksum,
    ShardFile,
    TensorSource,
    build_header,
    is_temp_name,
    temp_name,
    write_bytes_atomic,
    write_safetensors,
)
from netdist.errors import CheckpointCorruptError, CheckpointNotFoundError
from netdist.types import WIRE_DTYPES


def _write(path: Path, arrays: dict[str, np.ndarray], block_size: int = 64) -> FileRecord:
    sources = [TensorSource(n, a.dtype.name, a.shape, data=a) for n, a in arrays.items()]
    size, checksum = write_safetensors(path, sources, metadata={"k": "v"}, block_size=block_size)
    return FileRecord(0, path.name, size, checksum, block_size=block_size)


def test_header_golden_bytes() -> None:
    prefix, entries = build_header([("b", "float32", (2,)), ("a", "int16", (3,)),
                                    ("c", "float64", ())], {"format": "x"})
    text = (b'{"__metadata__":{"format":"x"},'
            b'"c":{"dtype":"F64","shape":[],"data_offsets":[0,8]},'
            b'"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},'
            b'"a":{"dtype":"I16","shape":[3],"data_offsets":[16,22]}}')
    padded = text + b" " * (-(len(text) + 8) % 8)
    assert prefix == struct.pack("<Q", len(padded)) + padded
    assert len(prefix) % 8 == 0
    assert [(e.name, e.begin - len(prefix), e.end - len(prefix)) for e in entries] == [
        ("c", 0, 8), ("b", 8, 16), ("a", 16, 22)]


def test_written_file_is_plain_safetensors(tmp_path: Path) -> None:
    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 3), np.int64),
        "flags": np.array([True, False, True]),
        "u8": np.arange(5, dtype=np.uint8),
        "be": np.arange(4, dtype=">i4"),  # big-endian input is stored little-endian
    }
    if "bfloat16" in WIRE_DTYPES:
        arrays["bf16"] = np.arange(4).astype(WIRE_DTYPES["bfloat16"])
    sources = [TensorSource(n, WIRE_DTYPES[a.dtype.name].name if a.dtype.name in WIRE_DTYPES
                            else a.dtype.name, a.shape, data=a) for n, a in arrays.items()]
    size, _ = write_safetensors(tmp_path / "x.safetensors", sources, metadata={"k": "v"})
    assert size == os.path.getsize(tmp_path / "x.safetensors")
    loaded = safetensors.numpy.load_file(tmp_path / "x.safetensors")
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array)
        assert loaded[name].shape == array.shape
    assert os.listdir(tmp_path) == ["x.safetensors"]


def test_chunked_producer_and_byte_count_checked(tmp_path: Path) -> None:
    data = np.arange(100, dtype=np.int32)
    buffer = np.empty(30, np.int32)

    def chunks():  # reuses one buffer, as the consolidator does
        for start in range(0, 100, 30):
            part = buffer[:min(30, 100 - start)]
            part[:] = data[start:start + len(part)]
            yield part

    write_safetensors(tmp_path / "c.safetensors",
                      [TensorSource("x", "int32", (100,), chunks=chunks)], block_size=16)
    np.testing.assert_array_equal(safetensors.numpy.load_file(tmp_path / "c.safetensors")["x"],
                                  data)
    with pytest.raises(ValueError, match="expected 400"):
        write_safetensors(tmp_path / "d.safetensors",
                          [TensorSource("x", "int32", (100,), chunks=lambda: [data[:50]])])
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"]  # no file, no temp left


def test_failed_write_leaves_previous_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    _write(path, {"a": np.ones(3)})
    before = path.read_bytes()

    def boom():
        yield np.zeros(2)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_safetensors(path, [TensorSource("a", "float64", (3,), chunks=boom)])
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["x.safetensors"]


def test_block_checksum_matches_whole_blocks() -> None:
    import zlib

    data = bytes(range(256)) * 5
    for pieces in ([data], [data[:7], data[7:300], data[300:]], [data[i:i + 1] for i in range(0, 200)]
                   + [data[200:]]):
        bc = BlockChecksum(100)
        for piece in pieces:
            bc.update(piece)
        expected = "".join(f"{zlib.crc32(data[i:i + 100]):08x}" for i in range(0, len(data), 100))
        assert bc.hexdigest() == expected


@pytest.mark.parametrize("verify", [True, False])
def test_read_box_matches_numpy_for_every_box(tmp_path: Path, verify: bool) -> None:
    full = np.arange(7 * 9 * 5, dtype=np.int16).reshape(7, 9, 5)
    other = np.arange(11, dtype=np.float64)
    record = _write(tmp_path / "t.safetensors", {"t": full, "o": other}, block_size=32)
    with ShardFile(tmp_path / "t.safetensors", record, verify=verify) as f:
        np.testing.assert_array_equal(f.read_tensor("o"), other)
        boxes = [(0, 7), (2, 5), (6, 7)], [(0, 9), (3, 4), (1, 8)], [(0, 5), (1, 3), (4, 5)]
        for box in itertools.product(*boxes):
            dest = np.full(tuple(b - a for a, b in box), -1, np.int16)
            f.read_box("t", box, dest)
            np.testing.assert_array_equal(dest, full[tuple(slice(a, b) for a, b in box)])
            # into a non-contiguous destination as well
            wide = np.full((dest.shape[0], dest.shape[1], dest.shape[2] * 2), -1, np.int16)
            f.read_box("t", box, wide[:, :, ::2])
            np.testing.assert_array_equal(wide[:, :, ::2], dest)


def test_small_read_touches_only_its_blocks(tmp_path: Path) -> None:
    full = np.arange(4096, dtype=np.float64)  # 32 KiB of data
    record = _write(tmp_path / "t.safetensors", {"t": full}, block_size=512)
    read: list[tuple[int, int]] = []

    class Spy(ShardFile):
        def _pread(self, offset: int, out: memoryview) -> None:
            read.append((offset, len(out)))
            super()._pread(offset, out)

    with Spy(tmp_path / "t.safetensors", record) as f:
        read.clear()
        dest = np.empty(100)
        f.read_box("t", ((1000, 1100),), dest)
    np.testing.assert_array_equal(dest, full[1000:1100])
    assert sum(n for _, n in read) <= 800 + 2 * 512  # the range plus at most two edge blocks


def test_flipped_byte_is_detected_with_offsets(tmp_path: Path) -> None:
    full = np.arange(1000, dtype=np.float32)
    path = tmp_path / "t.safetensors"
    record = _write(path, {"t": full}, block_size=256)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(raw)
    with ShardFile(path, record) as f:
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch in bytes"):
            f.read_tensor("t")
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            f.verify_all()
        head = np.empty(10, np.float32)
        f.read_box("t", ((0, 10),), head)  # blocks far from the flip still read fine
        np.testing.assert_array_equal(head, full[:10])
    with ShardFile(path, record, verify=False) as f:
        assert not np.array_equal(f.read_tensor("t"), full)


def test_flipped_header_byte_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    record = _write(path, {"t": np.arange(10.0)})
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0x20
    path.write_bytes(raw)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        ShardFile(path, record)


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    record = _write(path, {"t": np.arange(100.0)})
    os.truncate(path, record.size - 8)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        ShardFile(path, record)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        ShardFile(path, None)  # even without a record, the header disagrees with the size
    os.truncate(path, 4)
    with pytest.raises(CheckpointCorruptError, match="too short"):
        ShardFile(path, None)


def test_missing_file_and_garbage_header(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        ShardFile(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(CheckpointCorruptError, match="header length"):
        ShardFile(bad)
    bad.write_bytes(struct.pack("<Q", 4) + b"{]  ")
    with pytest.raises(CheckpointCorruptError, match="not JSON"):
        ShardFile(bad)
    header = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(CheckpointCorruptError, match="do not hold"):
        ShardFile(bad)


def test_atomic_small_file_and_temp_names(tmp_path: Path) -> None:
    write_bytes_atomic(tmp_path / "latest", b"step_000001\n")
    write_bytes_atomic(tmp_path / "latest", b"step_000002\n")
    assert (tmp_path / "latest").read_bytes() == b"step_000002\n"
    assert os.listdir(tmp_path) == ["latest"]
    name = temp_name("rank_00000.safetensors")
    assert is_temp_name(name) and not is_temp_name("rank_00000.safetensors")


def test_rank_file_golden_bytes(tmp_path: Path) -> None:
    import zlib

    path = tmp_path / "rank_00000.safetensors"
    size, checksum = write_safetensors(
        path, [TensorSource("x", "int16", (2,), data=np.array([1, -2], np.int16)),
               TensorSource("y", "float32", (), data=np.array(1.5, np.float32))],
        metadata={"rank": "0"})
    header = (b'{"__metadata__":{"rank":"0"},'
              b'"y":{"dtype":"F32","shape":[],"data_offsets":[0,4]},'
              b'"x":{"dtype":"I16","shape":[2],"data_offsets":[4,8]}}')
    header += b" " * (-(len(header) + 8) % 8)
    expected = (struct.pack("<Q", len(header)) + header + b"\x00\x00\xc0\x3f"
                + b"\x01\x00\xfe\xff")
    assert path.read_bytes() == expected
    assert size == len(expected)
    assert checksum == f"{zlib.crc32(expected):08x}"
