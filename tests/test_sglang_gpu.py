"""GPU test of the SGLang plugin on two GPUs of one host (skipped without two CUDA GPUs).

SGLang's own DCP merge functions, called with SGLang's own NCCL ``GroupCoordinator`` (a plain-torch stand-in
only if the coordinator cannot be built there; the result names which), give the same results with the
plugin routing to ``vmm`` and ``symm_a2a`` as SGLang's ``a2a`` does -- eager, in a CUDA graph, and for a T
above the workspace (served by SGLang's own code). The query route gives SGLang's gather bit-for-bit
(up to the sign of zero). Run on the 2-GPU machine::

    PEERDCP_WHEELS=$PWD/.whl bash scripts/setup_sglang.sh
    python -m pytest -q -s tests/test_sglang_gpu.py
"""

from __future__ import annotations

import json

import pytest
from conftest import GPU_WORLD

pytest.importorskip("sglang")

from on_ranks import sglang as R  # noqa: E402

pytestmark = pytest.mark.multigpu

ENV = {"PEERDCP_SGLANG_TIMEOUT_S": "20", "PEERDCP_SGLANG_MAX_TOKENS": "512"}
TS = [1, 3, 8, 64, 128, 256, 600]  # 600 > max_tokens: SGLang's own collective serves it


def test_sglang_merge_vmm_symm_match_sglang_a2a(pools):
    pool = pools(GPU_WORLD, "cpu:gloo,cuda:nccl")
    res = pool.run(R.gpu_merge_parity, ENV, TS, 16, 512, timeout=600)
    closed = pool.run(R.close_workspaces)
    print(json.dumps(res[0], indent=1))
    for rr in res:
        # SGLang's own NCCL GroupCoordinator; the plain-torch stand-in only if it could not be built (named)
        assert rr["group"] == "GroupCoordinator" or rr["group"].startswith("TorchGroup"), rr["group"]
        for row in rr["rows"]:
            if "graph_T" in row:
                assert all(row["graph_ok"]), row
                continue
            assert row["shapes_ok"], row
            if row["T"] <= 512:
                assert row["served"] == 2, row  # both SGLang functions went to peerdcp
                assert row["ulp_ok"], row
                assert row["routed_vs_ref"] <= 2 * row["sglang_a2a_vs_ref"] + 2**-8, row
            else:
                assert row["served"] == 0 and row["a2a_equal_when_unserved"], row
        mems = {(o["backend"], o["memory"]) for o in rr["objects"]}
        assert mems == {("vmm", "vmm"), ("symm_a2a", "symm")}, mems
    assert all(c["left"] == 0 and c["closed"] == 4 for c in closed), closed  # 2 backends x 2 LSE bases


def test_sglang_query_vmm_direct_matches_allgather(pools):
    pool = pools(GPU_WORLD, "cpu:gloo,cuda:nccl")
    res = pool.run(R.gpu_query_parity, ENV, [1, 8, 64, 256], 16, timeout=600)
    closed = pool.run(R.close_workspaces)
    print(json.dumps(res[0], indent=1))
    for rr in res:
        for row in rr["rows"]:
            assert row["served"] == 1 and row["equal"], row
    assert all(c["left"] == 0 and c["closed"] == 1 for c in closed), closed
