"""The encode tier (one process): preprocessing, ViT scheduling, embedding cache, transfer.

NOTE: set before MKL's first call in this process. On AVX-512 CPUs MKL picks GEMM kernels
by matrix size, so an image's embeddings could differ in the last bits depending on the
batch it was encoded in (measured: up to 6e-6 with the small checkpoint); strict
conditional numerical reproducibility makes each row batch-invariant, so a cached image
equals a freshly encoded one whatever batch computed it.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
