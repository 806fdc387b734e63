"""Output/LSE exchange: the DCP reduce of partial attention outputs (DESIGN.md sections 3, 5, 6).

* :mod:`.reference` - the combine spec in plain torch (read it first);
* :mod:`.kernels` - Triton kernels (fused direct exchange, combine, correction) and the inbox layout;
* :mod:`.ops` - the CUDA fast path (``csrc/output/direct.cu``) as the ``peerdcp::output_direct`` op;
* :mod:`.reducer` - :class:`OutputReducer`, the public class.
"""

from __future__ import annotations

from .reducer import BACKENDS, DIRECT_KERNEL_DEFAULT, KERNELS, TUNING, OutputReducer
from .reference import combine, combine_bounds, dcp_reduce, dcp_reduce_bounds, sanitize_lse

__all__ = [
    "OutputReducer",
    "BACKENDS",
    "KERNELS",
    "DIRECT_KERNEL_DEFAULT",
    "TUNING",
    "combine",
    "combine_bounds",
    "dcp_reduce",
    "dcp_reduce_bounds",
    "sanitize_lse",
]
