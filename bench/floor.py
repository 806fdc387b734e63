"""The per-call floor of the timing harness: a one-program Triton kernel that stores one value.

Import it only where it runs on a GPU: a benchmark's parent process that imports Triton before its CPU-smoke
ranks start breaks their interpreter launches (``bench.topk --cpu-smoke``; tests/test_bench_smoke.py guards it).
"""

import triton
import triton.language as tl


@triton.jit
def empty_kernel(out):
    tl.store(out + tl.program_id(0), 1.0)
