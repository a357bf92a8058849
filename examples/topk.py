# example: topk.py
import numpy as np

from netdist.compression import TopKCompressor

rng = np.random.default_rng(0)
compressor = TopKCompressor(ratio=0.01, error_feedback=True)
raw, sent = np.zeros(10_000), np.zeros(10_000)
for step in range(50):
    g = rng.normal(size=10_000)
    (sparse,) = compressor.compress([g])  # the 100 largest of |g + residual|; the rest carried over
    raw += g
    sent += sparse.to_dense()
print(f"{sparse.indices.size} of {g.size} kept, {sparse.nbytes} of {g.nbytes} bytes")
print("no gradient mass lost:", np.allclose(sent + compressor.residuals[0], raw))
