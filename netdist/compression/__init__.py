"""PURE gradient compression: top-k sparsification with error feedback, float16 casts.

Nothing here does I/O; the aggregators in ``netdist.parallel`` put the compressed form
on the wire.
"""

from netdist.compression.fp16 import FP16_MAX, Fp16Compressor, cast_to_fp16
from netdist.compression.topk import (
    CompressedGradient,
    TopKCompressor,
    compress_gradients,
    decompress_gradients,
    index_dtype,
    topk_count,
    topk_indices,
)

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
]
