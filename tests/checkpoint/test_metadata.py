"""Shard specs, metadata JSON round trip and the plain-value codec."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from netdist.checkpoint.metadata import (
    FORMAT_VERSION,
    MAX_JSON_DEPTH,
    FileRecord,
    Placement,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
    check_file_name,
    decode_json_value,
    encode_json_value,
    json_depth,
    parse_json,
    parse_step_dir_name,
    rank_file_name,
    step_dir_name,
)
from netdist.errors import CheckpointCorruptError, CheckpointVersionError


def test_spec_sharded_bounds_and_shapes() -> None:
    spec = TensorShardSpec((10, 4), 0, (4, 3, 3))
    assert spec.placement is Placement.SHARDED and not spec.is_replicated
    assert spec.num_shards == 3
    assert [spec.shard_bounds(r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert spec.local_shape(1) == (3, 4)
    assert spec.box(2) == ((7, 10), (0, 4))


def test_spec_even_uses_chunk_sizes_first_ranks_larger() -> None:
    spec = TensorShardSpec.even((5, 11), 3, shard_dim=1, dtype=np.float32)
    assert spec.shard_sizes == (4, 4, 3)
    assert spec.dtype == "float32"
    assert spec.local_shape(2) == (5, 3)


def test_spec_replicated_is_explicit() -> None:
    spec = TensorShardSpec.replicated((3, 2), "int64")
    assert spec.placement is Placement.REPLICATED and spec.is_replicated
    assert spec.shard_dim is None and spec.shard_sizes == ()
    assert spec.num_shards is None
    assert spec.box(5) == ((0, 3), (0, 2))
    with pytest.raises(ValueError, match="no shard bounds"):
        spec.shard_bounds(0)


@pytest.mark.parametrize("args, match", [
    (((4,), 0, (2, 1)), "sum to 3"),
    (((4,), 1, (4,)), "out of range"),
    (((4,), 0, ()), "needs shard_sizes"),
    (((4,), None, (4,)), "takes no shard_sizes"),
    (((-1,), None, ()), ">= 0"),
])
def test_spec_validation(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TensorShardSpec(*args)


def test_spec_rejects_unsupported_dtype() -> None:
    with pytest.raises(TypeError):
        TensorShardSpec((2,), 0, (2,), "complex64")


def _metadata() -> ShardMetadata:
    specs = {
        "w": TensorShardSpec((5, 3), 1, (2, 1), "float32"),
        "b": TensorShardSpec.replicated((3,), "float64"),
    }
    files = (FileRecord(0, rank_file_name(0), 200, "0000000a"),
             FileRecord(1, rank_file_name(1), 2**18 + 1, "00000001ffffffff"))
    state = StateLayout({"t": "object", "k": "step"}, {"step": 7}, {"rng": (1, 2**100)})
    return ShardMetadata(2, specs, mesh={"shape": [2], "dim_names": ["dp"]},
                         extra={"epoch": 3, "big": 2**127 + 5, "nan": math.nan},
                         step=100, writers={"b": 1}, files=files, state=state, generation=4)


def test_metadata_json_round_trip() -> None:
    meta = _metadata()
    text = meta.dumps()
    json.loads(text)  # plain, strict JSON
    back = ShardMetadata.loads(text)
    assert back.num_ranks == 2 and back.step == 100 and back.generation == 4
    assert back.tensor_specs == meta.tensor_specs
    assert back.writers == {"b": 1}
    assert back.files == meta.files
    assert back.mesh == {"shape": [2], "dim_names": ["dp"]}
    assert back.extra["epoch"] == 3 and back.extra["big"] == 2**127 + 5
    assert math.isnan(back.extra["nan"])
    assert back.state == meta.state
    assert back.dumps() == text


def test_metadata_version_from_the_future() -> None:
    doc = _metadata().to_json()
    doc["version"] = FORMAT_VERSION + 1
    with pytest.raises(CheckpointVersionError, match="newer"):
        ShardMetadata.from_json(doc)


@pytest.mark.parametrize("text", [b"{", b"[]", b'{"format": "other"}',
                                  b'{"format": "netdist-checkpoint", "version": 1}'])
def test_metadata_malformed_is_corrupt(text: bytes) -> None:
    with pytest.raises(CheckpointCorruptError):
        ShardMetadata.loads(text)


def test_metadata_validation() -> None:
    spec = TensorShardSpec((4,), 0, (2, 2))
    with pytest.raises(ValueError, match="split over 2 ranks"):
        ShardMetadata(3, {"x": spec})
    with pytest.raises(ValueError, match="not a replicated"):
        ShardMetadata(2, {"x": spec}, writers={"x": 0})
    with pytest.raises(ValueError, match="invalid tensor name"):
        ShardMetadata(1, {"__metadata__": TensorShardSpec.replicated((1,))})
    with pytest.raises(ValueError, match="num_ranks"):
        ShardMetadata(0, {})


def test_rebalanced_keeps_dims_and_uses_chunk_sizes() -> None:
    meta = ShardMetadata(2, {"w": TensorShardSpec((7, 2), 0, (4, 3)),
                             "v": TensorShardSpec((3, 5), 1, (1, 4)),
                             "r": TensorShardSpec.replicated((2,))})
    assert meta.rebalanced(2) == meta.tensor_specs  # same world size: saved layout
    new = meta.rebalanced(3)
    assert new["w"].shard_sizes == (3, 2, 2) and new["w"].shard_dim == 0
    assert new["v"].shard_sizes == (2, 2, 1) and new["v"].shard_dim == 1
    assert new["r"].is_replicated


def test_file_record_checks_digest_length() -> None:
    with pytest.raises(ValueError, match="checksum digits"):
        FileRecord(0, "x", 2**20 + 1, "00000000")
    record = FileRecord(0, "x", 5, "deadbeef", block_size=4 * 2**20)
    assert record.num_blocks == 1 and record.block_crc(0) == 0xDEADBEEF


def test_names() -> None:
    assert rank_file_name(3) == "rank_00003.safetensors"
    assert step_dir_name(100) == "step_000100"
    assert step_dir_name(1234567) == "step_1234567"
    assert parse_step_dir_name("step_000100") == 100
    assert parse_step_dir_name("step_x") is None
    assert parse_step_dir_name(".trash-step_000001-ab") is None
    with pytest.raises(ValueError):
        step_dir_name(-1)


@pytest.mark.parametrize("value", [
    None, True, 0, -5, 2**63 - 1, -(2**63), 2**64, -(2**70), 2**128 - 1, 1.5, "text", "",
    [1, [2, "x"]], (1, (2.5,)), {"a": {"b": 1}}, {0: "int key", 1: [1]}, {"$nd": 1},
    b"\x00\xff", {(1, 2): "tuple key"},
])
def test_object_codec_round_trip(value: object) -> None:
    encoded = encode_json_value(value)
    text = json.dumps(encoded, allow_nan=False)
    assert decode_json_value(json.loads(text)) == value


def test_object_codec_special_floats_and_numpy() -> None:
    back = decode_json_value(json.loads(json.dumps(
        encode_json_value([math.inf, -math.inf, math.nan, np.float32(1.5), np.int64(-3),
                           np.uint64(2**64 - 1), np.bool_(True)]), allow_nan=False)))
    assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])
    assert back[3] == np.float32(1.5) and type(back[3]) is np.float32
    assert back[4] == -3 and type(back[4]) is np.int64
    assert back[5] == 2**64 - 1 and type(back[5]) is np.uint64
    assert type(back[6]) is np.bool_


def test_object_codec_arrays_and_rngs() -> None:
    array = np.arange(6, dtype=np.uint32).reshape(2, 3)
    gen = np.random.default_rng(1234)
    gen.random(3)
    mt = np.random.MT19937(5)
    expected_state = gen.bit_generator.state
    encoded = json.loads(json.dumps(encode_json_value({"a": array, "g": gen, "mt": mt,
                                                       "state": gen.bit_generator.state})))
    back = decode_json_value(encoded)
    np.testing.assert_array_equal(back["a"], array)
    assert back["a"].dtype == np.uint32
    assert back["g"].bit_generator.state == gen.bit_generator.state
    assert back["g"].random() == gen.random()
    assert back["mt"].random_raw() == mt.random_raw()
    assert back["state"] == expected_state  # a plain dict holding 128-bit ints
    assert isinstance(back["state"]["state"]["state"], int)


def test_object_codec_refuses_arbitrary_objects() -> None:
    class Thing:
        pass

    with pytest.raises(TypeError, match="Thing"):
        encode_json_value({"x": Thing()})
    with pytest.raises(CheckpointCorruptError):
        decode_json_value({"$nd": "pickle", "v": "..."})
    with pytest.raises(CheckpointCorruptError):
        decode_json_value({"$nd": "generator", "v": {"bit_generator": "os.system"}})


def test_metadata_json_golden_text() -> None:
    meta = ShardMetadata(
        2, {"w": TensorShardSpec((3, 2), 0, (2, 1), "float32"),
            "b": TensorShardSpec.replicated((2,), "int64")},
        extra={"epoch": 1, "seed": 2**64}, step=7, writers={"b": 1},
        files=(FileRecord(0, "rank_00000.safetensors", 200, "0123abcd"),
               FileRecord(1, "rank_00001.safetensors", 180, "89abcdef")))
    assert meta.dumps() == """{
 "format": "netdist-checkpoint",
 "version": 1,
 "num_ranks": 2,
 "step": 7,
 "generation": 0,
 "mesh": null,
 "tensors": {
  "w": {"dtype": "float32", "shape": [3, 2], "placement": "sharded", "shard_dim": 0, "shard_sizes": [2, 1]},
  "b": {"dtype": "int64", "shape": [2], "placement": "replicated", "writer": 1}
 },
 "files": [
  {"rank": 0, "name": "rank_00000.safetensors", "size": 200, "checksum": {"algorithm": "crc32-blocks", "block_size": 262144, "blocks": "0123abcd"}},
  {"rank": 1, "name": "rank_00001.safetensors", "size": 180, "checksum": {"algorithm": "crc32-blocks", "block_size": 262144, "blocks": "89abcdef"}}
 ],
 "extra": {"epoch": 1, "seed": {"$nd": "int", "v": "18446744073709551616"}},
 "state": null
}
"""


def test_json_depth_and_bounded_parse() -> None:
    assert [json_depth(v) for v in (1, [], {"a": [1, {"b": []}]}, [[[]]])] == [0, 1, 4, 3]
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(parse_json(at_limit, "doc.json")) == MAX_JSON_DEPTH
    with pytest.raises(CheckpointCorruptError, match=r"^doc\.json: JSON nested deeper than 128"):
        parse_json("[" + at_limit + "]", "doc.json")
    with pytest.raises(CheckpointCorruptError, match=r"^doc\.json: JSON nested deeper"):
        parse_json("{\"a\": " * 200_000 + "1" + "}" * 200_000, "doc.json")  # past the stack
    with pytest.raises(CheckpointCorruptError, match=r"^doc\.json is not JSON"):
        parse_json(b"\xff", "doc.json")


def test_metadata_too_deep_for_readers_is_refused_at_save() -> None:
    nested: object = 1
    for _ in range(130):
        nested = [nested]
    meta = ShardMetadata(1, {}, extra={"deep": nested})
    with pytest.raises(ValueError, match="readers accept at most 128"):
        meta.dumps()


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "/abs", "a/b", "a\\b", "c:x",
                                  "nul\0"])
def test_file_names_must_be_plain(name: str) -> None:
    with pytest.raises(ValueError, match="is not a plain file name"):
        check_file_name(name)
    with pytest.raises(ValueError, match="is not a plain file name"):
        FileRecord(0, name, 0, "")
    assert check_file_name("rank_00000.safetensors") == "rank_00000.safetensors"


def test_shapes_are_bounded() -> None:
    with pytest.raises(ValueError, match="more than 64"):
        TensorShardSpec.replicated((1,) * 65)
    with pytest.raises(ValueError, match="past the int64 range"):
        TensorShardSpec.replicated((2**63,))
    with pytest.raises(ValueError, match="past the int64 range"):
        TensorShardSpec.replicated((2**32, 2**32))
    assert TensorShardSpec.replicated((2**62, 0)).full_shape == (2**62, 0)
