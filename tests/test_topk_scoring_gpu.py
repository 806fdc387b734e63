"""The indexer scoring kernel's launch options on GPU (one or more GPUs; skipped without CUDA)."""

from __future__ import annotations

import pytest
import rankfns_topk as fns

pytestmark = pytest.mark.cuda


def test_gpu_scoring_pdl_matches_plain_launch(pools):
    res = pools(1, "cpu:gloo,cuda:nccl").run(fns.scoring_pdl, 11)
    for r in res:
        assert r == {"new_token_seen": True, "eager1": True, "graph1": True, "eager2": True, "graph2": True}, r
