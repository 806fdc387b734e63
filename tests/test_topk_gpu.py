"""Indexer / Top-K on two or more GPUs (skipped without them): the same exactness as the CPU tests on
``vmm`` and ``symm`` memory, eager and CUDA-graph, the FP8 scoring kernel against the fp64 reference
(and bit-identical between owner-sharded and replicated caches), timeouts and bad input on device.

Run on the 2-GPU machine::

    python -m pytest -q tests/test_topk_gpu.py
"""

from __future__ import annotations

import pytest
from conftest import GPU_BACKEND, GPU_WORLD
from on_ranks import topk as fns

from peerdcp.topk.reference import local_length

pytestmark = [pytest.mark.multigpu, pytest.mark.cuda]

MEMORIES = ["vmm", "symm"]


def _check(res, world):
    for rank_res in res:
        for case in rank_res:
            info = {k: v for k, v in case.items() if not k.endswith("_rows")}
            assert case["direct"] and case["allgather"], info
            assert case["direct_owned"] and case["allgather_owned"], info
    for i in range(len(res[0])):
        digests = {res[r][i][b + "_digest"] for r in range(world) for b in ("direct", "allgather")}
        assert digests == {res[0][i]["expect_digest"]}, (i, digests)


MERGES = ["cuda", "triton"]  # the CUDA C++ merge (default on GPU) and its Triton twin


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("memory", MEMORIES)
def test_gpu_exact_selection_small_k(pools, memory, merge):
    res = pools(GPU_WORLD, GPU_BACKEND).run(
        fns.exactness, 16, (1, 64), [0, 1, 13, 16, 17, 320, 37], 3, memory=memory, device="cuda", merge_impl=merge
    )
    _check(res, GPU_WORLD)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("memory", MEMORIES)
def test_gpu_exact_selection_k2048(pools, memory, merge):
    lens = [0, 1, 2047, 2048, 2049, 4095, 50_000, 131_072]
    res = pools(GPU_WORLD, GPU_BACKEND).run(
        fns.exactness, 2048, (1, 64), lens, 4, memory=memory, device="cuda", merge_impl=merge
    )
    _check(res, GPU_WORLD)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("backend", ["direct", pytest.param("allgather", marks=pytest.mark.graph_collective)])
@pytest.mark.parametrize("interleave", [1, 64])
def test_gpu_cuda_graph_replays(pools, memory, backend, interleave, merge):
    res = pools(GPU_WORLD, GPU_BACKEND).run(
        fns.graph_exactness, 64, interleave, memory, backend, 10, 5, merge_impl=merge
    )
    for r in res:
        assert all(r["ok"]), r["ok"]
        assert r["backend"] == backend
        assert r["merge_impl"] == merge
    assert all(r["digests"] == res[0]["digests"] for r in res)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("memory", MEMORIES)
def test_gpu_back_to_back_without_barrier(pools, memory, merge):
    res = pools(GPU_WORLD, GPU_BACKEND).run(
        fns.back_to_back, 200, 64, 1, 8, 17, memory=memory, device="cuda", merge_impl=merge
    )
    for r in res:
        assert all(r["ok"]), [i for i, x in enumerate(r["ok"]) if not x]
    assert all(r["digests"] == res[0]["digests"] for r in res)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("memory", MEMORIES)
def test_gpu_back_to_back_mixed_publish_paths(pools, memory, pdl):
    """The publish inside the selection kernel (``select()``), the publish kernel (``select_publish`` off) and
    ``local_candidates()`` + ``merge()``, chosen per call and per rank at random, advance the same row epochs:
    200 back-to-back selections without a barrier, every one exact and the same on every rank; with and without
    ``select()``'s merge kernel launched by PDL."""
    res = pools(GPU_WORLD, GPU_BACKEND).run(
        fns.back_to_back, 200, 64, 1, 8, 23, memory=memory, device="cuda", merge_impl="cuda", mix_paths=True,
        merge_pdl=pdl,
    )  # fmt: skip
    for r in res:
        assert all(r["ok"]), [i for i, x in enumerate(r["ok"]) if not x]
    assert all(r["digests"] == res[0]["digests"] for r in res)


def test_gpu_rows_beyond_max_rows(pools):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.auto_fallback_rows, 64, 2, memory="auto", device="cuda")
    for r in res:
        assert r == {"backend": "direct", "T1": True, "T2": True, "T5": True}, r


@pytest.mark.parametrize("heads,interleave,upcast", [(64, 1, False), (32, 64, False), (64, 64, True)])
def test_gpu_scoring_kernel_against_reference(pools, heads, interleave, upcast):
    tune = {"scan_backend": "triton"}  # (the CUDA scan: test_gpu_cuda_scan_against_reference)
    res = pools(GPU_WORLD, GPU_BACKEND).run(
        fns.scoring, heads, 128, 64, interleave, 8, device="cuda", upcast=upcast, tuning=tune
    )
    for r in res:
        for lay in ("owner_sharded", "replicated"):
            assert r[lay]["values"] and r[lay]["mask"], r
        assert r["bitwise_vs_replicated"], r
        assert r["no_table"], r
        assert r["narrow_table"], r


@pytest.mark.parametrize(
    "heads,interleave,npage,min_ctas",
    [
        (64, 1, 0, 1),
        (32, 64, 0, 6),
        (48, 1, 1, 1),
        (64, 64, 3, 1),
        (20, 1, 7, 1),
        (64, 1, 64, 6),
        (8, 1, 2, 6),
        (64, 1, 5, 6),
    ],
)
def test_gpu_cuda_scan_against_reference(pools, heads, interleave, npage, min_ctas):
    """The CUDA scan (csrc/topk/score.cu) against the fp64 reference: both layouts, MTP rows, rows of 0 to 300
    tokens, a narrow and no block table, the head tiles of 32 and 64 (8, 20, 32, 48, 64 heads), 1 to 64 pages per
    CTA, both compiled register budgets; owner-sharded scores equal to the replicated ones bit for bit."""
    tune = {"scan_backend": "cuda", "cuda_scan_npage": npage, "cuda_scan_min_ctas": min_ctas}
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.scoring, heads, 128, 64, interleave, 8, device="cuda", tuning=tune)
    for r in res:
        for lay in ("owner_sharded", "replicated"):
            assert r[lay]["values"] and r[lay]["mask"], r
        assert r["bitwise_vs_replicated"] and r["no_table"] and r["narrow_table"], r
        assert r["cuda_calls"] == 4, r  # every scoring call of the case took the CUDA scan


@pytest.mark.parametrize("memory", MEMORIES)
def test_gpu_sharded_pipeline_matches_replicated(pools, memory):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.pipeline, 64, 128, 64, 1, 9, memory=memory, device="cuda")
    for r in res:
        assert r["equal_baseline"] and r["equal_reference"], r
        assert r["bytes"] == (16 // GPU_WORLD * 8448, 16 * 8448)  # 1/W of replicated
    assert all(r["digest"] == res[0]["digest"] for r in res)


def test_gpu_bad_input(pools):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.bad_inputs, memory="vmm", device="cuda")
    for r in res:
        assert "no error" not in r["errors"], r
        assert len(r["errors"]) == 22, r  # 19 + merge_impl unknown + timeout_s inf + max_rows=0 on the last rank only
        assert r["good_after"] and r["closed"] == ["ValueError"]
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.bad_cache_inputs, device="cuda")
    for r in res:
        # indexer_logits(max_seq_len=9) has local_length(9, rank 0) columns: 5 at W = 2, 3 at W = 4, 2 at W = 8
        assert "no error" not in r and f"ok (2, {local_length(9, 0, GPU_WORLD)})" in r, r


def test_gpu_audit_inputs_raise(pools):
    """tests/test_topk_host.py::test_audit_inputs_raise with CUDA tensors (the checks run before any launch)."""
    for r in pools(GPU_WORLD, GPU_BACKEND).run(fns.audit_inputs, device="cuda"):
        r.pop("aligned table")
        for name, msg in r.items():
            assert msg.startswith(("ValueError", "TypeError")), (name, msg)


def test_gpu_missing_peer_times_out(pools):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.missing_peer, 1, 2.0, memory="vmm", device="cuda")
    assert res[1] == "absent"
    for r, msg in enumerate(res):  # every present rank times out (at W > 2 possibly on a late present peer)
        if r == 1:
            continue
        first, again, check = msg.split(" | ")
        assert first.startswith(f"timeout rank={r} peer=") and " mech=topk" in first, msg
        assert (again, check) == ("refused", "refused"), msg
    assert any(m.startswith(f"timeout rank={r} peer=1 ") for r, m in enumerate(res) if r != 1), res
