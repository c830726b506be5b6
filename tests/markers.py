"""Skip markers for kernels a CPU may lack."""

from __future__ import annotations

import pytest

from worker.engine.weights.quantised import bfloat16_refusal

# oneDNN's bfloat16 matmul: absent on AVX2-only CPUs, where WEIGHTS=bfloat16 is refused (test_quant_linear tests
# the refusal there).
needs_bf16_matmul = pytest.mark.skipif(bfloat16_refusal() is not None,
                                       reason="oneDNN's bfloat16 matmul needs AVX-512 (BW, VL, DQ) or "
                                              "AVX-NE-CONVERT, which this CPU lacks")
BF16 = pytest.param("bfloat16", marks=needs_bf16_matmul)   # a "bfloat16" weights parameter, skipped without it
