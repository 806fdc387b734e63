"""Output/LSE exchange: the DCP reduce of partial attention outputs (DESIGN.md sections 3, 5, 6).

* :mod:`.reference` - the combine spec in plain torch (read it first);
* :mod:`.kernels` - Triton kernels (fused direct exchange, combine, correction) and the inbox layout;
* :mod:`.ops` - the CUDA fast path (``csrc/output/direct.cu``) as the ``peerdcp::output_direct`` op;
* :mod:`.policy` - every tuning value and rule (:class:`OutputPolicy`, :data:`DEFAULT_POLICY`);
* :mod:`.config` - the constructor's argument checks and agreement; :mod:`.setup` - the direct backend's set-up;
* :mod:`.reducer` - :class:`OutputReducer`, the public class.
"""

from __future__ import annotations

from .config import BACKENDS, KERNELS
from .policy import DEFAULT_POLICY, DIRECT_KERNEL_DEFAULT, TUNING, OutputPolicy, default_policy
from .reducer import OutputReducer
from .reference import combine, combine_bounds, dcp_reduce, dcp_reduce_bounds, sanitize_lse

__all__ = [
    "OutputReducer",
    "OutputPolicy",
    "DEFAULT_POLICY",
    "default_policy",
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
