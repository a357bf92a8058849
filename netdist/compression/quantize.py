"""PURE int8 / int4 quantization with per-chunk float32 scales, and error feedback.

A ``Quantization`` names the format: ``bits`` (8 or 4), ``scaling`` (``ABSMAX`` or
``MINMAX``) and ``chunk`` (elements per scale, even). ``quantize`` turns a 1-D float32
array into a uint8 buffer, ``dequantize`` turns the buffer back into float32.

Definitions (every operation a single IEEE float32 operation, round to nearest even, in
the order written; ``rint`` rounds half to even; so every machine gets the same bits):

- The array is cut into chunks of ``chunk`` elements from its start; the last chunk
  may be shorter. Each chunk ``c`` has its own scale ``s_c`` (and, for MINMAX, ``lo_c``).
- ABSMAX, ``L = 2**(bits-1) - 1`` (127 or 7): ``s_c = max|x| / L`` over the chunk;
  ``code = clip(rint(x / s_c), -L, L)``; decoded ``y = code * s_c``.
- MINMAX, ``L = 2**bits - 1`` (255 or 15): ``lo_c = min x``;
  ``s_c = (max x - lo_c) / L``; ``code = clip(rint((x - lo_c) / s_c), 0, L)``;
  decoded ``y = lo_c + code * s_c``.
- A chunk whose scale is 0 (all zeros; a constant chunk under MINMAX; a chunk whose
  range underflows to a scale of 0) divides by 1 instead of 0, which gives code 0
  everywhere: it decodes to exactly 0 (ABSMAX) or exactly ``lo_c`` (MINMAX), never NaN.
  So an all-zero chunk round-trips exactly under both scalings, a constant chunk under
  MINMAX.
- Only finite values within ``+-2**126`` (``MAX_MAGNITUDE``, about 8.5e37) can be
  quantized; anything else (NaN, +-inf, larger magnitudes, whose chunk range would
  overflow float32) raises ``netdist.errors.QuantizationError`` naming the first such
  element.

Buffer layout (``Quantization.wire_bytes(n)`` bytes): the codes, then every chunk's
scale as a little-endian float32, then (MINMAX only) every chunk's ``lo``. An 8-bit code
is one byte; 4-bit codes go two to a byte, element ``2i`` in the low nibble and ``2i+1``
in the high nibble, an odd last element padded with a 0 nibble. Codes are stored
offset-binary: ABSMAX stores ``code + 2**(bits-1)`` (1 .. 255 or 1 .. 15), MINMAX the code
itself. So ``n`` elements cost ``n`` (int8) or ``ceil(n/2)`` (int4) bytes plus 4 (ABSMAX)
or 8 (MINMAX) bytes per chunk.

Error bound (``error_bound``): for element ``i`` of chunk ``c``,

    |x_i - y_i| <= s_c / 2 + 2**-20 * (|x_i| + M_c) + 2**-140

where ``s_c`` is the chunk's stored scale and ``M_c = max |x|`` over the chunk: half a
step, plus the float32 roundings of the scale, the division, the product and (MINMAX)
the two subtractions and the addition (each at most ``2**-24`` relative; the constant
``2**-20`` covers them with room), plus an absolute term for subnormal results, whose
rounding is absolute (``2**-150`` per operation) rather than relative.

Error feedback (``ErrorFeedback``): what one quantization could not send is kept per key
and added to the next input under that key (Seide et al. 2014; Karimireddy et al. 2019):
``compensate(key, x)`` returns ``x + residual``; after sending, ``record(key, sent_input,
dequantized)`` keeps ``sent_input - dequantized``. Over any number of steps
``sum(dequantized) + residual == sum(x)``, up to the float32 rounding of the additions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.errors import ConfigError, QuantizationError

__all__ = [
    "MAX_MAGNITUDE",
    "Scaling",
    "Quantization",
    "quantize",
    "dequantize",
    "error_bound",
    "try_quantize",
    "poisoned_buffer",
    "is_poisoned",
    "ErrorFeedback",
]

MAX_MAGNITUDE = 2.0 ** 126
"""Largest magnitude ``quantize`` takes: a MINMAX chunk's range (at most twice this) and
every decoded value then stay finite in float32."""

_BLOCK_ELEMENTS = 1 << 16
"""Elements per block of the vectorised passes, so their float32 temporaries stay in
cache (whole chunks per block; at least one chunk)."""

_BOUND_RELATIVE = 2.0 ** -20
_BOUND_ABSOLUTE = 2.0 ** -140


class Scaling(enum.Enum):
    """How a chunk's scale is chosen."""

    ABSMAX = "absmax"
    """Symmetric: ``scale = max|x| / (2**(bits-1) - 1)``, codes ``-L .. L``; zero stays
    exactly zero."""
    MINMAX = "minmax"
    """Affine: ``scale = (max - min) / (2**bits - 1)`` and an offset ``min``; one more
    bit of resolution than ABSMAX for one-signed data, 4 more bytes per chunk."""


@dataclass(frozen=True, slots=True)
class Quantization:
    """A quantization format: ``bits`` (8 or 4), ``scaling`` (``Scaling`` or its name)
    and ``chunk`` (elements per scale: even, >= 2). ``str()`` gives the text
    ``Quantization.parse`` reads (``"int8:minmax:1024"``)."""

    bits: int = 8
    scaling: Scaling = Scaling.MINMAX
    chunk: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) \
                or self.bits not in (4, 8):
            raise ConfigError(f"Quantization bits must be 8 or 4, got {self.bits!r}")
        scaling = self.scaling
        if isinstance(scaling, str) and not isinstance(scaling, Scaling):
            try:
                scaling = Scaling(scaling.lower())
            except ValueError:
                raise ConfigError(f"Quantization scaling must be 'absmax' or 'minmax', "
                                  f"got {self.scaling!r}") from None
            object.__setattr__(self, "scaling", scaling)
        elif not isinstance(scaling, Scaling):
            raise ConfigError(f"Quantization scaling must be a Scaling or 'absmax' / "
                              f"'minmax', got {self.scaling!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) \
                or self.chunk < 2 or self.chunk % 2:
            raise ConfigError(f"Quantization chunk must be an even int >= 2, "
                              f"got {self.chunk!r}")

    def __str__(self) -> str:
        return f"int{self.bits}:{self.scaling.value}:{self.chunk}"

    @property
    def levels(self) -> int:
        """``L``: the largest code magnitude (ABSMAX: 127 or 7; MINMAX: 255 or 15)."""
        if self.scaling is Scaling.ABSMAX:
            return (1 << (self.bits - 1)) - 1
        return (1 << self.bits) - 1

    def code_bytes(self, n: int) -> int:
        """Bytes of the codes of ``n`` elements (the buffer's first part)."""
        return n if self.bits == 8 else (n + 1) // 2

    def chunks(self, n: int) -> int:
        """How many chunks (scales) ``n`` elements have."""
        return -(-n // self.chunk)

    def wire_bytes(self, n: int) -> int:
        """Bytes ``quantize`` produces for ``n`` elements: the codes plus 4 (ABSMAX) or 8
        (MINMAX) bytes per chunk."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"wire_bytes needs a number of elements >= 0, got {n!r}")
        n = int(n)
        per_chunk = 4 if self.scaling is Scaling.ABSMAX else 8
        return self.code_bytes(n) + per_chunk * self.chunks(n)

    @classmethod
    def parse(cls, text: str) -> Quantization:
        """Read ``"int8"``, ``"int4"``, ``"int8:absmax"``, ``"int4:minmax:256"``
        (``int<bits>[:<scaling>[:<chunk>]]``, defaults for what is left out);
        ``ConfigError`` naming the text otherwise."""
        if not isinstance(text, str):
            raise ConfigError(f"Quantization.parse needs a string, got {type(text).__name__}")
        parts = text.strip().lower().split(":")
        usage = ("expected int8 or int4, then optionally ':absmax' or ':minmax', then "
                 "optionally ':<chunk>' (e.g. 'int4:minmax:256')")
        if not 1 <= len(parts) <= 3 or parts[0] not in ("int8", "int4"):
            raise ConfigError(f"cannot read quantization {text!r}: {usage}")
        fields: dict[str, Any] = {"bits": int(parts[0][3:])}
        if len(parts) >= 2:
            if parts[1] not in ("absmax", "minmax"):
                raise ConfigError(f"cannot read quantization {text!r}: scaling {parts[1]!r}; "
                                  f"{usage}")
            fields["scaling"] = Scaling(parts[1])
        if len(parts) == 3:
            if not parts[2].isdigit():
                raise ConfigError(f"cannot read quantization {text!r}: chunk {parts[2]!r} "
                                  f"is not a number; {usage}")
            fields["chunk"] = int(parts[2])
        return cls(**fields)


# --------------------------------------------------------------------------- helpers


def _pieces(n: int, chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """``(start, stop, first_chunk, rows)``: runs of whole chunks (``rows`` x ``chunk``
    elements, a block at a time), then the partial last chunk as one row."""
    full = n // chunk
    per_block = max(1, _BLOCK_ELEMENTS // chunk)
    for c0 in range(0, full, per_block):
        c1 = min(c0 + per_block, full)
        yield c0 * chunk, c1 * chunk, c0, c1 - c0
    if n % chunk:
        yield full * chunk, n, full, 1


def _float32_vector(x: Any, what: str) -> np.ndarray:
    array = np.asarray(x)
    if array.dtype != np.float32:
        raise TypeError(f"{what} needs a float32 array, got {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{what} needs a 1-D array, got shape {array.shape}")
    return array


def _chunk_extremes(x: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk's min and max (float32; NaN where the chunk holds a NaN)."""
    count = q.chunks(x.size)
    lows = np.empty(count, np.float32)
    highs = np.empty(count, np.float32)
    for start, stop, c0, rows in _pieces(x.size, q.chunk):
        view = x[start:stop].reshape(rows, -1)
        np.min(view, axis=1, out=lows[c0:c0 + rows])
        np.max(view, axis=1, out=highs[c0:c0 + rows])
    return lows, highs


def _in_range(lows: np.ndarray, highs: np.ndarray) -> bool:
    """Every value within +-MAX_MAGNITUDE (False for NaN, whose comparisons are false)."""
    limit = np.float32(MAX_MAGNITUDE)
    return bool(np.all(lows >= -limit) and np.all(highs <= limit))


def _out_of_range_message(x: np.ndarray, what: str) -> str:
    bad = np.flatnonzero(~(np.abs(x) <= np.float32(MAX_MAGNITUDE)))
    first = int(bad[0])
    return (f"{what}: element {first} of {x.size} is {x[first]!r} ({bad.size} such "
            f"element(s)); only finite values within +-2**126 can be quantized")


def _scales(lows: np.ndarray, highs: np.ndarray, q: Quantization) -> np.ndarray:
    """Every chunk's scale, by the module's definition (float32)."""
    levels = np.float32(q.levels)
    if q.scaling is Scaling.ABSMAX:
        magnitude = np.maximum(np.negative(lows), highs)  # max|x|, exactly
        return np.divide(magnitude, levels, dtype=np.float32)
    return np.divide(np.subtract(highs, lows, dtype=np.float32), levels, dtype=np.float32)


def _sections(buf: np.ndarray, n: int, q: Quantization
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of a buffer's codes, scales and offsets (MINMAX; empty for ABSMAX)."""
    code_bytes, count = q.code_bytes(n), q.chunks(n)
    scales = buf[code_bytes:code_bytes + 4 * count].view("<f4")
    offset_count = count if q.scaling is Scaling.MINMAX else 0
    offsets = buf[code_bytes + 4 * count:code_bytes + 4 * (count + offset_count)].view("<f4")
    return buf[:code_bytes], scales, offsets


def try_quantize(x: np.ndarray, q: Quantization) -> np.ndarray | None:
    """``quantize(x, q)`` for a float32 1-D ``x`` (not checked), or ``None`` where
    ``quantize`` would raise ``QuantizationError`` (a collective sends a poisoned buffer
    then, instead of leaving its peers waiting)."""
    n = x.size
    lows, highs = _chunk_extremes(x, q)
    if n and not _in_range(lows, highs):
        return None
    out = np.empty(q.wire_bytes(n), np.uint8)
    codes, scale_view, offset_view = _sections(out, n, q)
    scales = _scales(lows, highs, q)
    divisors = np.where(scales == 0, np.float32(1), scales)
    levels = float(q.levels)
    absmax = q.scaling is Scaling.ABSMAX
    bias = float(1 << (q.bits - 1)) if absmax else 0.0
    for start, stop, c0, rows in _pieces(n, q.chunk):
        view = x[start:stop].reshape(rows, -1)
        divisor = divisors[c0:c0 + rows, None]
        if absmax:
            t = np.divide(view, divisor, dtype=np.float32)
            np.rint(t, out=t)
            np.clip(t, -levels, levels, out=t)
            t += np.float32(bias)
        else:
            t = np.subtract(view, lows[c0:c0 + rows, None], dtype=np.float32)
            np.divide(t, divisor, out=t)
            np.rint(t, out=t)
            np.clip(t, 0.0, levels, out=t)
        flat = t.reshape(-1)
        if q.bits == 8:
            np.copyto(codes[start:stop], flat, casting="unsafe")
        else:  # start is even (a multiple of the even chunk): the piece starts a byte
            small = np.zeros(flat.size + (flat.size & 1), np.uint8)
            np.copyto(small[:flat.size], flat, casting="unsafe")
            packed = codes[start // 2:start // 2 + small.size // 2]
            np.left_shift(small[1::2], 4, out=packed)
            packed |= small[0::2]
    scale_view[:] = scales
    if not absmax:
        offset_view[:] = lows
    return out


# --------------------------------------------------------------------------- public


def quantize(x: np.ndarray, q: Quantization) -> np.ndarray:
    """The uint8 buffer (``q.wire_bytes(x.size)`` bytes) holding float32 1-D ``x``
    quantized as the module docstring defines. ``TypeError`` for another dtype,
    ``ValueError`` for another shape, ``QuantizationError`` for a value that is NaN,
    infinite or beyond ``+-2**126``."""
    x = _float32_vector(x, "quantize")
    buf = try_quantize(x, q)
    if buf is None:
        raise QuantizationError(_out_of_range_message(x, "quantize"))
    return buf


def dequantize(buf: np.ndarray, n: int, q: Quantization,
               out: np.ndarray | None = None) -> np.ndarray:
    """The ``n`` float32 values ``buf`` (from ``quantize`` with ``q``) decodes to, into
    ``out`` (float32, C-contiguous, ``n`` elements) if given; returns that array."""
    buf = np.asarray(buf)
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise TypeError(f"dequantize needs a 1-D uint8 buffer, got {buf.dtype} {buf.shape}")
    if buf.size != q.wire_bytes(n):
        raise ValueError(f"dequantize: {n} elements as {q} take {q.wire_bytes(n)} bytes, "
                         f"the buffer holds {buf.size}")
    if out is None:
        out = np.empty(n, np.float32)
    elif (out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous
          or not out.flags.writeable):
        raise ValueError(f"dequantize: out must be a writeable C-contiguous float32 array of "
                         f"{n} elements, got {out.dtype} {out.shape}")
    buf = np.ascontiguousarray(buf)
    codes, scales, offsets = _sections(buf, n, q)
    flat_out = out.reshape(-1)
    absmax = q.scaling is Scaling.ABSMAX
    bias = np.float32(1 << (q.bits - 1))
    for start, stop, c0, rows in _pieces(n, q.chunk):
        if q.bits == 8:
            piece = codes[start:stop]
        else:
            packed = codes[start // 2:(stop + 1) // 2]
            piece = np.empty(2 * packed.size, np.uint8)
            np.bitwise_and(packed, 0x0F, out=piece[0::2])
            np.right_shift(packed, 4, out=piece[1::2])
            piece = piece[:stop - start]
        target = flat_out[start:stop].reshape(rows, -1)
        codes_2d = piece.reshape(rows, -1)
        scale = scales[c0:c0 + rows, None].astype(np.float32)
        if absmax:
            np.subtract(codes_2d, bias, out=target, dtype=np.float32)  # exact
            np.multiply(target, scale, out=target)
        else:
            np.multiply(codes_2d, scale, out=target, dtype=np.float32)
            np.add(target, offsets[c0:c0 + rows, None].astype(np.float32), out=target)
    return out


def error_bound(x: np.ndarray, q: Quantization) -> np.ndarray:
    """Per element of float32 1-D ``x``, a bound (float64) on
    ``|x - dequantize(quantize(x, q), x.size, q)|``:
    ``s_c / 2 + 2**-20 * (|x_i| + max|x| over the chunk) + 2**-140`` (module docstring).
    Raises as ``quantize`` does."""
    x = _float32_vector(x, "error_bound")
    lows, highs = _chunk_extremes(x, q)
    if x.size and not _in_range(lows, highs):
        raise QuantizationError(_out_of_range_message(x, "error_bound"))
    scales = _scales(lows, highs, q).astype(np.float64)
    magnitude = np.maximum(-lows.astype(np.float64), highs.astype(np.float64))
    per_chunk = 0.5 * scales + _BOUND_RELATIVE * magnitude + _BOUND_ABSOLUTE
    bound = np.empty(x.size, np.float64)
    for start, stop, c0, rows in _pieces(x.size, q.chunk):
        target = bound[start:stop].reshape(rows, -1)
        np.abs(x[start:stop].reshape(rows, -1), out=target, dtype=np.float64)
        target *= _BOUND_RELATIVE
        target += per_chunk[c0:c0 + rows, None]
    return bound


def poisoned_buffer(n: int, q: Quantization) -> np.ndarray:
    """A buffer of ``n`` elements that decodes to NaN everywhere (every scale NaN): what
    a quantized collective sends in place of values ``quantize`` refused, so the ranks
    it reaches can tell, instead of waiting for it."""
    buf = np.zeros(q.wire_bytes(n), np.uint8)
    _, scales, _ = _sections(buf, n, q)
    scales[:] = np.nan
    return buf


def is_poisoned(buf: np.ndarray, n: int, q: Quantization) -> bool:
    """Whether ``buf`` (``n`` elements as ``q``) has a NaN scale, which ``quantize``
    never writes: it came from ``poisoned_buffer``."""
    _, scales, _ = _sections(np.ascontiguousarray(buf), n, q)
    return bool(np.isnan(scales).any())


# --------------------------------------------------------------------------- feedback


class ErrorFeedback:
    """Float32 residuals keyed by name: what a quantization could not send, added to the
    next input under the same key.

    ``compensate(key, x)`` returns ``x + residual`` (a new float32 array; ``x`` itself
    when there is no residual yet is copied, never returned); ``record(key, sent_input,
    dequantized)`` keeps ``sent_input - dequantized``. A key's shape is fixed by its
    first residual: another shape is a ``ConfigError`` naming the key and both shapes
    (``reset(key)`` forgets a key).
    """

    def __init__(self) -> None:
        self._residuals: dict[str, np.ndarray] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._residuals

    def keys(self) -> list[str]:
        """The keys holding a residual, in the order they were first recorded."""
        return list(self._residuals)

    def residual(self, key: str) -> np.ndarray | None:
        """``key``'s residual (the array itself, not a copy), or ``None``."""
        return self._residuals.get(key)

    def reset(self, key: str | None = None) -> None:
        """Forget ``key``'s residual, or every residual."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def _check(self, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
        held = self._residuals.get(key)
        if held is not None and held.shape != shape:
            raise ConfigError(f"error feedback key {key!r}: its residual has shape "
                              f"{held.shape}, the input has shape {shape}; use one key per "
                              f"tensor, or reset({key!r}) when the tensor changes")
        return held

    def compensate(self, key: str, x: np.ndarray) -> np.ndarray:
        """``x + residual`` as a new float32 array (a float32 copy of ``x`` if ``key``
        has no residual yet)."""
        x = np.asarray(x)
        held = self._check(key, x.shape)
        if held is None:
            return np.array(x, dtype=np.float32, copy=True)
        with np.errstate(over="ignore", invalid="ignore"):  # quantize names what is bad
            return np.add(x, held, dtype=np.float32)

    def record(self, key: str, sent_input: np.ndarray, dequantized: np.ndarray) -> None:
        """Keep ``sent_input - dequantized`` (float32) as ``key``'s residual."""
        sent_input, dequantized = np.asarray(sent_input), np.asarray(dequantized)
        if sent_input.shape != dequantized.shape:
            raise ValueError(f"error feedback key {key!r}: the input has shape "
                             f"{sent_input.shape}, its dequantized form {dequantized.shape}")
        held = self._check(key, sent_input.shape)
        if held is None:
            self._residuals[key] = np.subtract(sent_input, dequantized, dtype=np.float32)
        else:
            np.subtract(sent_input, dequantized, out=held, dtype=np.float32)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every residual, copied, by key (plain arrays, for checkpoints)."""
        return {key: r.copy() for key, r in self._residuals.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace every residual by those of ``state`` (from ``state_dict``)."""
        loaded: dict[str, np.ndarray] = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise ConfigError(f"error feedback state keys are strings, got {key!r}")
            loaded[key] = np.array(value, dtype=np.float32, copy=True)
        self._residuals = loaded
