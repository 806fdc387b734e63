"""Query: the widened MLA query of a DCP group - direct peer-memory exchange with fused RoPE + FP8/BF16
(producer stores: push, LL / SN / LL12 / LL128 push on the CUDA kernel; or consumer loads: raw, roped,
zero-copy).

Start with :mod:`peerdcp.query.reference` (the plain-torch specification), then :mod:`.rope` (the
``cos_sin_cache`` tables: plain, YaRN for DeepSeek-V3.2 and Kimi-K2), :mod:`.kernels` (Triton: the
direct protocol and the fused allgather pass; their row numerics in :mod:`.rows`, the buffer layout in
:mod:`.layout`), ``csrc/query/direct.cu`` (the CUDA twin, :mod:`.ops`; the sentinel push's word rules in plain
Python: :mod:`.sentinel`), :mod:`.policy` (every tuning rule: :class:`QueryPolicy`) and :class:`QueryGather`
(the public object; its argument checks in :mod:`.config`, its set-up in :mod:`.setup`, the allgather backend in
:mod:`.allgather`).
"""

from __future__ import annotations

from . import reference, rope
from .config import BACKENDS, EXCHANGES, IMPLS
from .gather import QueryGather
from .policy import AUTO_PUSH_RAW_MAX_TOKENS, AUTO_RAW_MAX_TOKENS, DEFAULT_POLICY, ByDtype, QueryPolicy
from .reference import apply_rope, quantize_fp8, rope_quantize_kv, widened_query, widened_query_bounds
from .rope import PRESETS, YarnParams, cos_sin_cache, plain_cos_sin_cache, yarn_cos_sin_cache

__all__ = [
    "QueryGather",
    "QueryPolicy",
    "DEFAULT_POLICY",
    "ByDtype",
    "BACKENDS",
    "IMPLS",
    "EXCHANGES",
    "AUTO_RAW_MAX_TOKENS",
    "AUTO_PUSH_RAW_MAX_TOKENS",
    "reference",
    "rope",
    "apply_rope",
    "quantize_fp8",
    "widened_query",
    "widened_query_bounds",
    "rope_quantize_kv",
    "PRESETS",
    "YarnParams",
    "cos_sin_cache",
    "plain_cos_sin_cache",
    "yarn_cos_sin_cache",
]
