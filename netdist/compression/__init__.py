"""PURE gradient compression: top-k sparsification with error feedback, float16 casts,
int8 / int4 quantization with per-chunk scales (``quantize``; the collectives that put
it on the wire are ``netdist.collectives.QuantizedReducer``).

Nothing here does I/O; the aggregators in ``netdist.parallel`` put the compressed form
on the wire.

Names resolve lazily (``netdist._lazy``), like every netdist package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "CompressedGradient": "netdist.compression.topk",
    "TopKCompressor": "netdist.compression.topk",
    "compress_gradients": "netdist.compression.topk",
    "decompress_gradients": "netdist.compression.topk",
    "topk_count": "netdist.compression.topk",
    "topk_indices": "netdist.compression.topk",
    "index_dtype": "netdist.compression.topk",
    "Fp16Compressor": "netdist.compression.fp16",
    "cast_to_fp16": "netdist.compression.fp16",
    "FP16_MAX": "netdist.compression.fp16",
    "Quantization": "netdist.compression.quantize",
    "Scaling": "netdist.compression.quantize",
    "quantize": "netdist.compression.quantize",
    "dequantize": "netdist.compression.quantize",
    "error_bound": "netdist.compression.quantize",
    "ErrorFeedback": "netdist.compression.quantize",
}

__all__ = [
    "CompressedGradient",
    "TopKCompressor",
    "compress_gradients",
    "decompress_gradients",
    "topk_count",
    "topk_indices",
    "index_dtype",
    "Fp16Compressor",
    "cast_to_fp16",
    "FP16_MAX",
    "Quantization",
    "Scaling",
    "quantize",
    "dequantize",
    "error_bound",
    "ErrorFeedback",
]

if TYPE_CHECKING:
    from netdist.compression.fp16 import FP16_MAX, Fp16Compressor, cast_to_fp16
    from netdist.compression.quantize import (
        ErrorFeedback,
        Quantization,
        Scaling,
        dequantize,
        error_bound,
        quantize,
    )
    from netdist.compression.topk import (
        CompressedGradient,
        TopKCompressor,
        compress_gradients,
        decompress_gradients,
        index_dtype,
        topk_count,
        topk_indices,
    )
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
