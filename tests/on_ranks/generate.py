"""Rank side of the ``peerdcp generate`` tests: what only a test asks of the decode phases."""

from __future__ import annotations

import torch

from peerdcp.integrations.transformers import decode


def forced_matches_adopted() -> dict:
    """After :func:`decode.adopt_free_as_forced`: decode teacher-forced anyway and compare with what was adopted
    (logits bit for bit, every layer's top-k ids of every call)."""
    S = decode._S
    logits, ids = S["dcp_forced_logits"], S["dcp_forced_ids"]
    decode.dcp_forced()
    again, ids_again = S["dcp_forced_logits"], S["dcp_forced_ids"]
    same_ids = ids.keys() == ids_again.keys() and all(
        len(ids[k]) == len(ids_again[k]) and all(torch.equal(a, b) for a, b in zip(ids[k], ids_again[k])) for k in ids
    )
    return {"logits_equal": bool(torch.equal(logits, again)), "ids_equal": same_ids, "calls": len(ids_again.get(0, []))}
