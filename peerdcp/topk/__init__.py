"""Indexer / Top-K for DSA models under DCP: owner-sharded index-K cache, FP8 indexer scoring, and the
exact canonical global top-k (direct peer-memory candidate exchange, or all-gather).

Read in this order: ``reference.py`` (the specification), ``kernels.py`` (Triton), ``ops.py`` (the C boundary and
its ``torch.library`` ops), ``policy.py`` (:class:`TopKPolicy`, every tuning rule), ``cache.py``
(:class:`IndexKCache`), ``scorer.py`` (:func:`indexer_logits`), ``candidates.py`` (the local selection and
:func:`canonical_topk`), ``config.py`` (argument checks, buffer layout), ``selector.py`` (:class:`TopK`).

Decode step on rank r of a DCP group of W::

    cache.write(slots, k_fp8, k_scale)                  # keeps only the tokens rank r owns
    logits = indexer_logits(q_fp8, weights, cache, seq_lens, max_seq_len=...)   # [T, L_local_max]
    ids = tk.select(logits, seq_lens)                   # [T, 2048] global ids, same on every rank
    rows, counts = tk.owned(ids)                        # rank r's local KV rows for sparse attention
"""

from __future__ import annotations

from . import reference
from .cache import LAYOUTS, IndexKCache
from .candidates import MAX_TOPK, canonical_topk
from .policy import DEFAULT_POLICY, TopKPolicy
from .scorer import indexer_logits
from .selector import BACKENDS, TopK

__all__ = [
    "IndexKCache",
    "indexer_logits",
    "TopK",
    "canonical_topk",
    "reference",
    "LAYOUTS",
    "BACKENDS",
    "MAX_TOPK",
    "TopKPolicy",
    "DEFAULT_POLICY",
]
