"""The same-host shared-memory path: host layouts, segments, the setup's agreement and
fallback, and the shared-memory collectives' exact results (in-process ranks, which
share a host; ``test_multiprocess.py`` runs real processes, one host and two pretend
hosts, and SIGKILLs one mid-round)."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.collectives.host import attach
from netdist.collectives.host.peer_arrays import FOLD_BLOCK_BYTES
from netdist.collectives.host.layout import MAX_LOCAL_RANKS, HostLayout, LocalMode
from netdist.collectives.host.segments import HEADER_BYTES, SegmentLocator, SharedSegment
from netdist.collectives.host.settings import ShmCopy, shared_memory_copy, shared_memory_enabled
from netdist.errors import CollectiveMismatchError, SharedMemoryError
from netdist.transport.host_identity import host_key
from netdist.reduce_kernels import combine
from netdist.types import ReduceOp

from .helpers import RING, assert_bitwise_equal
from tests.ranks import run_ranks

SLOT = 64 * 1024  # small slots: many rounds, both parities, partial last rounds


# -- layouts (pure) ----------------------------------------------------------------------

def test_layout_single_host() -> None:
    layout = HostLayout.from_keys([b"a"] * 4, [True] * 4, rank=2)
    assert layout.mode is LocalMode.SINGLE_HOST
    assert layout.hosts == ((0, 1, 2, 3),) and layout.local == 2 and not layout.is_leader
    assert layout.cross_ranks == (2,)


def test_layout_hierarchical_groups_by_key_in_rank_order() -> None:
    layout = HostLayout.from_keys([b"x", b"y", b"x", b"y"], [True] * 4, rank=3)
    assert layout.mode is LocalMode.HIERARCHICAL
    assert layout.hosts == ((0, 2), (1, 3))
    assert (layout.host, layout.local) == (1, 1)
    assert layout.local_ranks == (1, 3) and layout.cross_ranks == (2, 3)


@pytest.mark.parametrize("keys, enabled", [
    ([b"a", b"b", b"c"], [True] * 3),         # nobody shares a host
    ([b"a"] * 3, [True, False, True]),        # one rank has it off
    ([b"a"] * 33, [True] * 33),                # more ranks on a host than MAX_LOCAL_RANKS
])
def test_layout_falls_back_to_tcp(keys: list[bytes], enabled: list[bool]) -> None:
    assert HostLayout.from_keys(keys, enabled, rank=0).mode is LocalMode.TCP


def test_layout_uneven_hosts_lane_by_the_smallest_host() -> None:
    layout = HostLayout.from_keys([b"a", b"b", b"b", b"c", b"c", b"c"], [True] * 6, rank=4)
    assert layout.mode is LocalMode.UNEVEN_HOSTS
    assert layout.hosts == ((0,), (1, 2), (3, 4, 5))
    assert (layout.host, layout.local, layout.lanes) == (2, 1, 1)
    assert layout.lane(0) == (0, 1, 3) and layout.host_of(2) == 1


def test_max_local_ranks_is_the_bound_used_above() -> None:
    assert MAX_LOCAL_RANKS == 32
    keys = [b"a"] * MAX_LOCAL_RANKS
    assert HostLayout.from_keys(keys, [True] * len(keys), 0).mode is LocalMode.SINGLE_HOST


def test_host_key_follows_netdist_host_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NETDIST_HOST_ID", raising=False)
    plain = host_key()
    assert host_key() == plain and len(plain) == 16
    monkeypatch.setenv("NETDIST_HOST_ID", "other")
    assert host_key() != plain


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("no", False),
                                             ("1", True), ("", True)])
def test_netdist_shm_variable(monkeypatch: pytest.MonkeyPatch, value: str,
                              expected: bool) -> None:
    monkeypatch.setenv("NETDIST_SHM", value)
    assert shared_memory_enabled(None) is expected
    assert shared_memory_enabled(True) is True and shared_memory_enabled(False) is False


@pytest.mark.parametrize("value, expected", [("single", ShmCopy.SINGLE),
                                             ("Staged", ShmCopy.STAGED)])
def test_netdist_shm_copy_variable(monkeypatch: pytest.MonkeyPatch, value: str,
                                   expected: ShmCopy) -> None:
    monkeypatch.setenv("NETDIST_SHM_COPY", value)
    assert shared_memory_copy(None) is expected
    assert shared_memory_copy("staged") is ShmCopy.STAGED
    monkeypatch.delenv("NETDIST_SHM_COPY")
    assert shared_memory_copy(None) is ShmCopy.SINGLE
    monkeypatch.setenv("NETDIST_SHM_COPY", "twice")
    with pytest.raises(ValueError, match="NETDIST_SHM_COPY must be 'single' or 'staged', "
                                         "got 'twice'"):
        shared_memory_copy(None)


# -- single-copy reads (cross-memory attach) ----------------------------------------------

def test_read_into_copies_this_process_memory_exactly() -> None:
    source = np.arange(100_000, dtype=np.int64)
    out = np.empty(50_000, np.int64)
    attach.read_into(os.getpid(), source.ctypes.data + 25_000 * 8, out)
    assert np.array_equal(out, source[25_000:75_000])


def test_write_from_copies_into_this_process_memory_exactly() -> None:
    target = np.zeros(100_000, dtype=np.int64)
    data = np.arange(50_000, dtype=np.int64)
    attach.write_from(os.getpid(), target.ctypes.data + 25_000 * 8, data)
    assert np.array_equal(target[25_000:75_000], data)
    assert not target[:25_000].any() and not target[75_000:].any()


def test_probe_names_memory_it_can_read_but_not_write() -> None:
    import ctypes
    import mmap

    token = b"0123456789abcdef"
    page = mmap.mmap(-1, mmap.PAGESIZE)
    page[:16] = token
    view = np.frombuffer(page, np.uint8)
    address = view.ctypes.data
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # the kernel refuses a cross-memory write into a read-only mapping (EFAULT)
    assert libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ) == 0
    try:
        target = attach.ProbeTarget(os.getpid(), address, token)
        assert attach.probe_peer(target, "group rank 3") == (
            "cannot write group rank 3's memory: Bad address")
    finally:
        assert libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        del view
        page.close()


def test_read_of_a_finished_process_is_esrch() -> None:
    import errno
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True, timeout=60)
    with pytest.raises(attach.RemoteReadError) as caught:
        attach.read_into(int(child.stdout), 4096, np.empty(8, np.uint8))
    assert caught.value.errno == errno.ESRCH


def test_probe_reads_the_token_back_and_names_what_is_wrong() -> None:
    token = attach.ProbeToken()
    target = token.target
    assert attach.probe_peer(target, "group rank 1") is None
    forged = attach.ProbeTarget(target.pid, target.address, bytes(16))
    assert attach.probe_peer(forged, "group rank 1") == (
        "group rank 1's memory does not hold the token it announced")
    assert attach.probe_peer(attach.ProbeTarget.unpack([1, "x", b"t"]), "group rank 2") == (
        "group rank 2 sent a malformed probe")
    assert attach.ProbeTarget.unpack(target.pack()) == target


# -- segments ----------------------------------------------------------------------------

def test_segment_attach_sees_the_creators_bytes_and_nothing_lands_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    created = SharedSegment.create(4096)
    try:
        attached = SharedSegment.attach(created.locator, peer="test")
        created.array(10, 3)[:] = [1, 2, 3]
        assert attached.array(10, 3).tolist() == [1, 2, 3]
        assert os.stat(f"/proc/self/fd/{created.locator.fd}").st_mode & 0o777 == 0o600
        assert set(os.listdir("/dev/shm")) == before
        attached.close()
    finally:
        created.close()


def test_segment_with_a_wrong_cookie_is_refused() -> None:
    created = SharedSegment.create(4096)
    try:
        forged = SegmentLocator(created.locator.pid, created.locator.fd, created.locator.size,
                                bytes(16))
        with pytest.raises(SharedMemoryError, match="cookie"):
            SharedSegment.attach(forged, peer="group rank 0")
        wrong_size = SegmentLocator(created.locator.pid, created.locator.fd,
                                    created.locator.size + 64, created.locator.cookie)
        with pytest.raises(SharedMemoryError, match="bytes, expected"):
            SharedSegment.attach(wrong_size, peer="group rank 0")
    finally:
        created.close()


def test_locator_naming_a_file_that_is_not_a_segment_is_refused() -> None:
    with tempfile.TemporaryFile() as f:
        f.write(bytes(4096))
        f.flush()
        locator = SegmentLocator(os.getpid(), f.fileno(), 4096, bytes(16))
        with pytest.raises(SharedMemoryError, match="not a netdist segment"):
            SharedSegment.attach(locator, peer="group rank 3")


def test_locator_of_a_closed_descriptor_is_a_clear_error() -> None:
    created = SharedSegment.create(4096)
    locator = created.locator
    created.release_fd()
    try:
        with pytest.raises(SharedMemoryError, match="cannot open group rank 1's"):
            SharedSegment.attach(locator, peer="group rank 1")
    finally:
        created.close()


@pytest.mark.parametrize("fields", [None, [1, 2, 3], [1, 2, 3, b"x"], ["1", 2, 4096, bytes(16)],
                                    [1, -1, 4096, bytes(16)], [1, 2, HEADER_BYTES, bytes(16)]])
def test_malformed_locators_are_refused(fields: object) -> None:
    with pytest.raises(SharedMemoryError, match="malformed"):
        SegmentLocator.unpack(fields)


def test_segment_views_are_bounded() -> None:
    segment = SharedSegment.create(4096)
    with pytest.raises(SharedMemoryError, match="outside"):
        segment.array(4000, 200)
    segment.close()
    with pytest.raises(SharedMemoryError, match="closed"):
        segment.array(0, 1)


# -- setup: agreement and fallback --------------------------------------------------------

async def test_groups_on_one_host_use_shared_memory(data_path: str) -> None:
    async def body(g: Group) -> LocalMode | None:
        assert g.local_mode is None  # nothing large has run yet
        await g.all_reduce(np.ones(10_000, np.float32))
        return g.local_mode

    modes = await run_ranks(3, body, small_message_bytes=RING)
    expected = LocalMode.SINGLE_HOST if data_path == "shm" else LocalMode.TCP
    assert modes == [expected] * 3


async def test_one_rank_without_shared_memory_puts_the_group_on_tcp() -> None:
    from netdist.transport import InProcessTransport

    transports = InProcessTransport.create_group(3, timeout=10)
    groups = [Group(t, small_message_bytes=RING, shared_memory=t.rank != 1)
              for t in transports]
    arrays = [np.full(5000, r + 1, np.int64) for r in range(3)]
    async with asyncio.timeout(30):
        await asyncio.gather(*(g.all_reduce(a) for g, a in zip(groups, arrays)))
    assert [g.local_mode for g in groups] == [LocalMode.TCP] * 3
    assert all(np.array_equal(a, np.full(5000, 6)) for a in arrays)
    for g in groups:
        await g.aclose()
    for t in transports:
        await t.aclose()


async def test_a_rank_that_cannot_attach_puts_everyone_on_tcp_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(locator: SegmentLocator, *, peer: str) -> SharedSegment:
        raise SharedMemoryError(f"cannot open {peer}'s shared-memory segment: denied")

    monkeypatch.setattr(SharedSegment, "attach", staticmethod(refuse))
    paths, said = await _sum_saying(caplog, logging.WARNING, "shared memory off", 3,
                                    small_message_bytes=RING, shared_memory=True)
    assert paths == [(LocalMode.TCP, None)] * 3
    assert len(said) == 1 and "group rank 1: cannot open group rank 0's" in said[0]


async def _sum_saying(caplog: pytest.LogCaptureFixture, level: int, phrase: str,
                      ranks: int | list[Group], **options: object
                      ) -> tuple[list[tuple[LocalMode | None, ShmCopy | None]], list[str]]:
    """Every rank all-reduces ``rank + 1`` (checked exactly); the data path each rank took,
    and the log lines at ``level`` containing ``phrase``."""
    async def body(g: Group) -> tuple[LocalMode | None, ShmCopy | None]:
        array = np.full(5000, g.rank + 1, np.int64)
        await g.all_reduce(array)
        n = g.world_size
        assert np.array_equal(array, np.full(5000, n * (n + 1) // 2))
        return g.local_mode, g.local_copy

    with caplog.at_level(level, logger="netdist.collectives"):
        paths = await run_ranks(ranks, body, close=True, **options)
    return paths, [r.getMessage() for r in caplog.records if phrase in r.getMessage()]


async def test_one_rank_staging_puts_the_host_on_staged_copies_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    from netdist.transport import InProcessTransport

    groups = [Group(t, small_message_bytes=RING, shared_memory=True,
                    shm_copy="staged" if t.rank == 2 else None)
              for t in InProcessTransport.create_group(3, timeout=10)]
    paths, said = await _sum_saying(caplog, logging.INFO, "stages its copies", groups)
    assert paths == [(LocalMode.SINGLE_HOST, ShmCopy.STAGED)] * 3
    assert len(said) == 1 and "group rank 2: single copy is off on this rank" in said[0]


async def test_a_rank_that_cannot_read_its_peers_puts_the_host_on_staged_copies(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(target: attach.ProbeTarget | None, peer: str) -> str | None:
        return f"cannot read {peer}'s memory: Operation not permitted"

    monkeypatch.setattr(attach, "probe_peer", refuse)
    paths, said = await _sum_saying(caplog, logging.INFO, "stages its copies", 2,
                                    small_message_bytes=RING, shared_memory=True)
    assert paths == [(LocalMode.SINGLE_HOST, ShmCopy.STAGED)] * 2
    assert len(said) == 1 and "cannot read group rank 1's memory" in said[0]


async def test_single_copy_all_reduce_of_different_sizes_is_a_mismatch_error() -> None:
    async def body(g: Group) -> str:
        await g.all_reduce(np.ones(1000, np.float32))  # sets the arena up
        with pytest.raises(CollectiveMismatchError) as caught:
            await g.all_reduce(np.ones(5000 + 1000 * g.rank, np.float32), timeout=10)
        return str(caught.value)

    errors = await run_ranks(2, body, small_message_bytes=RING, shared_memory=True,
                             shm_copy=ShmCopy.SINGLE)
    assert "group rank 1 has a 24000-byte array in this all_reduce, group rank 0 20000" in errors[0]
    assert "every rank must pass the same shape and dtype" in errors[0]


# -- results -----------------------------------------------------------------------------

def _fold(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Lowest rank first, as the shared-memory path folds."""
    out = arrays[0].copy()
    for other in arrays[1:]:
        combine(op, out, other, out)
    return out


@pytest.mark.parametrize("copy", list(ShmCopy))
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MEAN])
async def test_all_reduce_folds_lowest_rank_first_bitwise(n: int, op: ReduceOp,
                                                          copy: ShmCopy) -> None:
    rng = np.random.default_rng(5)
    size = 50_001 if copy is ShmCopy.STAGED else 3 * FOLD_BLOCK_BYTES // 4 * n + 7
    inputs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]

    async def body(g: Group) -> tuple[np.ndarray, ShmCopy | None]:
        array = inputs[g.rank].copy()
        await g.all_reduce(array, op)
        return array, g.local_copy

    outcomes = await run_ranks(n, body, small_message_bytes=RING, shared_memory=True,
                               shm_slot_bytes=SLOT, shm_copy=copy)
    assert [used for _, used in outcomes] == [copy] * n
    results = [array for array, _ in outcomes]
    assert_bitwise_equal(results)
    expected = _fold(inputs, ReduceOp.SUM if op is ReduceOp.MEAN else op)
    if op is ReduceOp.MEAN:
        expected = expected / np.float32(n)
    assert results[0].tobytes() == expected.tobytes()


async def test_collectives_in_flight_together_take_turns_on_the_slots() -> None:
    n, count = 3, 6

    async def body(g: Group) -> list[np.ndarray]:
        arrays = [np.full(40_000 + 1000 * k, (g.rank + 1) * (k + 1), np.int64)
                  for k in range(count)]
        works = [await g.all_reduce(a, async_op=True) for a in arrays[:3]]
        works.append(await g.all_gather(arrays[3], async_op=True))
        works.append(await g.broadcast(arrays[4], 1, async_op=True))
        works.append(await g.reduce_scatter(arrays[5], async_op=True))
        return [await w for w in works]

    results = await run_ranks(n, body, small_message_bytes=RING, shared_memory=True,
                              shm_slot_bytes=SLOT)
    total = n * (n + 1) // 2
    for rank, got in enumerate(results):
        for k in range(3):
            assert np.array_equal(got[k], np.full(40_000 + 1000 * k, total * (k + 1)))
        assert np.array_equal(got[3], np.concatenate(
            [np.full(43_000, (r + 1) * 4) for r in range(n)]))
        assert np.array_equal(got[4], np.full(44_000, 2 * 5))
        assert np.array_equal(got[5], np.full(len(got[5]), total * 6))


@pytest.mark.parametrize("copy", list(ShmCopy))
async def test_bfloat16_mean_through_shared_memory_matches_the_ordered_fold(
        copy: ShmCopy) -> None:
    from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16

    rng = np.random.default_rng(9)
    inputs = [float32_to_bfloat16(rng.standard_normal(300_001).astype(np.float32))
              for _ in range(3)]

    async def body(g: Group) -> np.ndarray:
        array = inputs[g.rank].copy()
        await g.all_reduce(array, ReduceOp.MEAN)
        return array

    results = await run_ranks(3, body, small_message_bytes=RING, shared_memory=True,
                              shm_slot_bytes=SLOT, shm_copy=copy)
    summed = bfloat16_to_float32(_fold(inputs, ReduceOp.SUM))
    expected = float32_to_bfloat16(summed / np.float32(3))  # one rounding, as torch divides
    assert_bitwise_equal(results)
    assert results[0].view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


async def test_subgroups_get_their_own_segments() -> None:
    async def body(g: Group) -> tuple[np.ndarray, LocalMode | None]:
        sub = g.new_group([0, 2, 3])
        array = np.full(20_000, g.rank + 1, np.int64)
        if sub.is_member:
            await sub.all_reduce(array)
        await g.all_reduce(array)
        return array, sub.local_mode

    results = await run_ranks(4, body, small_message_bytes=RING, shared_memory=True,
                              shm_slot_bytes=SLOT)
    # members: 1 + 3 + 4 = 8 after the subgroup; then the world sums 8 + 2 + 8 + 8
    for array, _ in results:
        assert np.array_equal(array, np.full(20_000, 26))
    assert [mode for _, mode in results] == [LocalMode.SINGLE_HOST, None,
                                             LocalMode.SINGLE_HOST, LocalMode.SINGLE_HOST]
