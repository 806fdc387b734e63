"""The indexer scoring kernel's launch options on GPU (one or more GPUs; skipped without CUDA)."""

from __future__ import annotations

import pytest
import rankfns_topk as fns

pytestmark = pytest.mark.cuda


def test_gpu_scoring_pdl_matches_plain_launch(pools):
    res = pools(1, "cpu:gloo,cuda:nccl").run(fns.scoring_pdl, 11)
    for r in res:
        assert r == {"new_token_seen": True, "eager1": True, "graph1": True, "eager2": True, "graph2": True}, r


@pytest.mark.parametrize("npage", [5, 6, 10, 12])
def test_gpu_scoring_pages_per_program(pools, npage):
    """The mid-size rule's pages-per-program counts (not powers of two; programs that run past a row's end) give
    the fp64 reference's scores and -inf masks (rows of 0 to 300 tokens, MTP rows, a narrow block table)."""
    res = pools(1, "cpu:gloo,cuda:nccl").run(fns.scoring, 64, 128, 64, 1, 8, device="cuda", npage=npage)
    for r in res:
        for lay in ("owner_sharded", "replicated"):
            assert r[lay]["values"] and r[lay]["mask"], r
        assert r["bitwise_vs_replicated"] and r["no_table"] and r["narrow_table"], r
