"""Large-count fuzz of the frame decoder: counts violations of its one fuzz rule.

The rule (docs/PROTOCOL.md section 5): any byte sequence either decodes or raises
``netdist.errors.RemoteProtocolError`` -- never another exception. The test suite checks
it with a few thousand hypothesis examples; this script runs hundreds of thousands of
seeded inputs, far more than a test run can afford, and prints how many broke the rule
(must be 0), with the first few offending inputs.

Inputs, in equal thirds:

* data frames whose shape mixes zeros, small and huge dimensions (up to 2**64-1), so the
  product is often 0 while a dimension is beyond what NumPy can describe (issue 12,
  item 11), with a payload length that matches the product, or not;
* valid frames (data and control) with random bit flips, byte sets, insertions,
  deletions and truncations;
* random bytes behind a valid magic and version.

Each input is decoded twice, once letting the decoder allocate payloads and once with
caller-supplied destinations, fed whole and then in random pieces.

    python benchmarks/decoder_fuzz.py [--count 450000] [--seed 12] [--show 5]
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from collections import Counter
from typing import Any

import msgpack
import numpy as np

from netdist.config import WireLimits
from netdist.errors import RemoteProtocolError
from netdist.types import WIRE_DTYPES
from netdist.wire import NEED_DATA, DataStart, FrameDecoder, FrameKind, encode_control, encode_data

_NAMES = sorted(WIRE_DTYPES)
_SMALL = WireLimits(max_header_bytes=256, max_payload_bytes=4096, max_ndim=8)
_HUGE = [2**k + d for k in (30, 31, 32, 40, 48, 52, 56, 60, 61, 62, 63, 64)
         for d in (-1, 0, 1)]


def _raw_frame(kind: int, header: bytes, payload: bytes, plen: int | None = None) -> bytes:
    return (struct.pack("<2sBBIQ", b"ND", 1, kind, len(header),
                        len(payload) if plen is None else plen) + header + payload)


def _dimension(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.35:
        return 0
    if roll < 0.65:
        return rng.randint(1, 4)
    if roll < 0.9:
        return min(rng.choice(_HUGE), 2**64 - 1)
    return rng.randint(0, 2**64 - 1)


def shape_frame(rng: random.Random) -> bytes:
    """A data frame with a zero-heavy, huge-dimension shape."""
    name = rng.choice(_NAMES)
    shape = [_dimension(rng) for _ in range(rng.randint(0, 6))]
    nbytes = 1
    for dim in shape:
        nbytes *= dim
    nbytes *= WIRE_DTYPES[name].itemsize
    header = msgpack.packb({"tag": rng.randint(0, 2**63 - 1), "dtype": name, "shape": shape})
    if nbytes <= 64 and rng.random() < 0.9:
        return _raw_frame(0, header, bytes(nbytes))
    plen = nbytes if nbytes < 2**64 and rng.random() < 0.5 else rng.randint(0, 2**64 - 1)
    return _raw_frame(0, header, b"", plen=plen)


def _seeds() -> list[bytes]:
    def join(parts: list[Any]) -> bytes:
        return b"".join(bytes(part) for part in parts)

    return [
        join(encode_data(np.arange(3, dtype=np.float32), tag=7)),
        join(encode_data(np.zeros((2, 0, 3), np.int64), tag=0)),
        join(encode_data(np.zeros((0, 5), np.uint8), tag=1)),
        join(encode_data(np.uint16(9), tag=2**40)),
        encode_control(FrameKind.HEARTBEAT),
        encode_control(FrameKind.HELLO, {"version": 1, "job_id": "j", "rank": 1,
                                         "world_size": 2, "role": "rank", "nonce": bytes(32)}),
        encode_control(FrameKind.ERROR, {"reason": "no", "nested": {"a": [1, {"b": None}]}}),
    ]


_SEEDS = _seeds()


def mutated_frame(rng: random.Random) -> bytes:
    """One to three valid frames with one to six random mutations."""
    data = bytearray(b"".join(rng.choice(_SEEDS) for _ in range(rng.randint(1, 3))))
    for _ in range(rng.randint(1, 6)):
        if not data:
            break
        pos = rng.randrange(len(data))
        op = rng.randrange(5)
        if op == 0:
            data[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[pos] = rng.randrange(256)
        elif op == 2:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del data[pos:pos + rng.randint(1, 8)]
        else:
            del data[pos:]
    return bytes(data)


def random_frame(rng: random.Random) -> bytes:
    """Random bytes behind a valid magic and version (so the later checks are reached)."""
    return b"ND\x01" + rng.randbytes(rng.randint(0, 120))


def decode(data: bytes, cuts: list[int], limits: WireLimits, give_destination: bool) -> None:
    """Feed ``data`` split at ``cuts``; raises whatever the decoder raises."""
    dec = FrameDecoder(limits, scratch_bytes=64)
    prev = 0
    try:
        for cut in [*cuts, len(data)]:
            dec.feed(data[prev:cut])
            prev = cut
            while (event := dec.next_event()) is not NEED_DATA:
                if give_destination and isinstance(event, DataStart):
                    dec.set_payload_destination(np.empty(event.header.nbytes, np.uint8))
    except RemoteProtocolError:
        if not dec.failed:
            raise AssertionError("RemoteProtocolError raised but the decoder is not failed")


def run(count: int, seed: int, show: int) -> int:
    """Fuzz ``count`` inputs; print the result; return the number of rule violations."""
    rng = random.Random(seed)
    makers = (shape_frame, mutated_frame, random_frame)
    violations: Counter[str] = Counter()
    examples: list[tuple[bytes, str]] = []
    started = time.perf_counter()
    for i in range(count):
        data = makers[i % 3](rng)
        cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 3)))
        for limits, cut_list, dest in ((WireLimits(), [], False), (_SMALL, cuts, True)):
            try:
                decode(data, cut_list, limits, dest)
            except Exception as exc:  # the rule: nothing but RemoteProtocolError
                what = f"{type(exc).__name__}: {exc}"
                violations[type(exc).__name__] += 1
                if len(examples) < show:
                    examples.append((data, what))
    elapsed = time.perf_counter() - started
    total = sum(violations.values())
    print(f"decoder fuzz: {count} inputs (x2 decodes), seed {seed}, {elapsed:.1f}s")
    print(f"rule violations (anything but RemoteProtocolError): {total}")
    for name, n in violations.most_common():
        print(f"  {name}: {n}")
    for data, what in examples:
        print(f"  e.g. {data[:80].hex()}{'...' if len(data) > 80 else ''}\n    -> {what[:160]}")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=450_000, help="inputs to generate")
    parser.add_argument("--seed", type=int, default=12, help="random seed (reproducible)")
    parser.add_argument("--show", type=int, default=5, help="offending inputs to print")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be >= 1")
    return 1 if run(args.count, args.seed, args.show) else 0


if __name__ == "__main__":
    sys.exit(main())
