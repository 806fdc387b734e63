"""Indexer / Top-K for DSA models under DCP: owner-sharded index-K cache, FP8 indexer scoring, and the
exact canonical global top-k (direct peer-memory candidate exchange, or all-gather).

Read in this order: ``reference.py`` (the specification), ``kernels.py`` (Triton), ``cache.py``
(:class:`IndexKCache`, :func:`indexer_logits`), ``selector.py`` (:class:`TopK`, :func:`canonical_topk`).

Decode step on rank r of a DCP group of W::

    cache.write(slots, k_fp8, k_scale)                  # keeps only the tokens rank r owns
    logits = indexer_logits(q_fp8, weights, cache, seq_lens, max_seq_len=...)   # [T, L_local_max]
    ids = tk.select(logits, seq_lens)                   # [T, 2048] global ids, same on every rank
    rows, counts = tk.owned(ids)                        # rank r's local KV rows for sparse attention
"""

from __future__ import annotations

from . import reference
from .cache import LAYOUTS, IndexKCache, indexer_logits
from .selector import BACKENDS, MAX_TOPK, TopK, canonical_topk

__all__ = [
    "IndexKCache",
    "indexer_logits",
    "TopK",
    "canonical_topk",
    "reference",
    "LAYOUTS",
    "BACKENDS",
    "MAX_TOPK",
]
