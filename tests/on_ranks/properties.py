"""Rank functions for tests/test_properties.py (run in a 1-rank pool: Triton interpreter on CPU)."""

from __future__ import annotations

import torch

from peerdcp.topk import reference as ref
from peerdcp.topk.candidates import canonical_topk


def topk_matches_bruteforce(logits: list[list[float]], lens: list[int], k: int) -> tuple[bool, str]:
    x = torch.tensor(logits, dtype=torch.float32)
    seq = torch.tensor(lens, dtype=torch.int64)
    got = canonical_topk(x, seq, k)
    want = ref.select_reference(x, seq, k)
    if torch.equal(got.cpu(), want):
        return True, ""
    return False, f"got {got.tolist()}\nwant {want.tolist()}"
