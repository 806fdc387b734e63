"""Indexer / Top-K on CPU: real rank processes over host memory, the Triton kernels in the interpreter.

Covers: exact canonical selection (set and order) under heavy ties, NaN, +-0, +-inf, forced tokens and
sequence lengths 0, 1, < k, = k, >> k; direct == allgather == reference on every rank and on repeated
runs; owned() partitions each selection; T > max_rows falls back to allgather; 50 back-to-back calls
without a barrier; bad input; a missing peer; leaks; the index-K cache round trip and capacity; the
scoring kernel against the fp64 reference; the whole sharded pipeline against the replicated one.
"""

from __future__ import annotations

import pytest
import torch
from on_ranks import topk as fns

from peerdcp.topk import reference as ref

# an empty row right after a row of >> k tokens: a merge store one past its row would land in that row's -1s
LENS = {16: [0, 1, 13, 16, 17, 320, 0, 37], 64: [64, 0, 1, 63, 1500, 0, 65]}


def _check_exactness(res: list[list[dict]], world: int) -> None:
    for rank_res in res:
        for case in rank_res:
            info = {k: v for k, v in case.items() if not k.endswith("_rows")}
            assert case["direct"] and case["allgather"], info
            assert case["direct_owned"] and case["allgather_owned"], info
            assert case["candidates"], info  # local_candidates() are reference.pack_keys, bit for bit
    # identical on every rank, for both backends
    for i in range(len(res[0])):
        digests = {res[r][i][b + "_digest"] for r in range(world) for b in ("direct", "allgather")}
        assert digests == {res[0][i]["expect_digest"]}, (i, digests)


def _check_partition(res: list[list[dict]], world: int, lens: list[int]) -> None:
    """Every selected token appears in exactly one rank's owned() list, at its local row, in order."""
    for i, case in enumerate(res[0]):
        I = case["I"]
        for t, L in enumerate(lens):
            for b in ("direct", "allgather"):
                per_rank = [res[r][i][b + "_owned_rows"][t] for r in range(world)]
                back = [[int(ref.global_id(l, r, world, I)) for l in rows if l >= 0] for r, rows in enumerate(per_rank)]
                union = sorted(g for gs in back for g in gs)
                assert len(union) == len(set(union)), (i, t, b)
                assert all(g < L for g in union), (i, t, b)
                n_sel = min(L, case["K"])
                assert len(union) == n_sel, (i, t, b, len(union), n_sel)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exact_selection_small_k(pools, world):
    res = pools(world).run(fns.exactness, 16, (1, 64), LENS[16], 100 + world)
    _check_exactness(res, world)
    _check_partition(res, world, LENS[16])


def test_exact_selection_k64_w3(pools):
    res = pools(3).run(fns.exactness, 64, (1, 64), LENS[64], 7)
    _check_exactness(res, 3)
    _check_partition(res, 3, LENS[64])


def test_exact_selection_default_k2048(pools):
    lens = [5003]
    res = pools(2).run(fns.exactness, 2048, (1,), lens, 11)
    _check_exactness(res, 2)
    _check_partition(res, 2, lens)


def test_rows_beyond_max_rows_use_allgather(pools):
    res = pools(2).run(fns.auto_fallback_rows, 16, 5)
    for r in res:
        assert r == {"backend": "direct", "T1": True, "T2": True, "T5": True}, r


@pytest.mark.parametrize("world,interleave", [(2, 1), (3, 64)])
def test_fifty_back_to_back_without_barrier(pools, world, interleave):
    res = pools(world).run(fns.back_to_back, 50, 16, interleave, 3, 9 + world)
    for r in res:
        assert all(r["ok"]), [i for i, x in enumerate(r["ok"]) if not x]
        assert r["digests"] == res[0]["digests"]


def test_bad_input_raises_before_launch(pools):
    res = pools(2).run(fns.bad_inputs)
    for rank, r in enumerate(res):
        assert r["errors"] == (
            ["ValueError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError", "ValueError"]
            + ["ValueError"]  # timeout_s inf
            + ["ValueError", "ValueError"]  # merge_impl unknown; merge_impl="cuda" without a GPU
            + ["ValueError"]
            + ["ValueError" if rank == 1 else "PeerSetupError names it"]  # max_rows=0 on rank 1 only
            + ["TypeError", "ValueError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError"]
            + ["TypeError", "ValueError", "TypeError", "ValueError", "ValueError"]
        ), r["errors"]
        assert r["good_after"] is True
        assert r["closed"] == ["ValueError"]


def test_cache_bad_input(pools):
    res = pools(2).run(fns.bad_cache_inputs)
    for r in res:
        assert r == (
            ["ValueError", "ValueError", "ValueError", "ValueError", "ValueError", "TypeError", "ValueError"]
            + ["TypeError", "TypeError", "ValueError", "TypeError", "ValueError"]
            + ["TypeError", "ValueError", "ValueError", "TypeError", "ValueError", "TypeError", "ValueError"]
            + ["TypeError", "ok (2, 5)", "ValueError"]
        ), r


def test_missing_peer_raises_timeout(pools):
    res = pools(2).run(fns.missing_peer, 1, 1.5)
    assert res[1] == "absent"
    first, again, check = res[0].split(" | ")
    assert first.startswith("timeout rank=0 peer=1 mech=topk"), res[0]
    assert 0.3 < float(first.split("dt=")[1]) < 10.0, res[0]
    assert (again, check) == ("refused", "refused"), res[0]


def test_create_close_leaves_nothing(pools):
    """No fd and no shared-memory mapping survives 20 TopK + IndexKCache lifetimes (per process: other
    processes on the host may hold segments of their own)."""
    res = pools(2).run(fns.create_close_cycles, 20)
    for r in res:
        assert r["after"]["fds"] <= r["before"]["fds"], r
        assert r["after"]["maps"] == r["before"]["maps"] == 0, r


@pytest.mark.parametrize("world,interleave", [(2, 1), (3, 64)])
@pytest.mark.parametrize("layout", ["owner_sharded", "replicated"])
def test_cache_write_read_roundtrip(pools, world, interleave, layout):
    res = pools(world).run(fns.cache_roundtrip, interleave, layout)
    owned = [r["owned"] for r in res]
    n = len(owned[0])
    for r in res:
        assert r["data"] and r["scales"], r
        assert r["stored"] == sum(r["owned"]), r  # nothing but the owned tokens was written
        assert r["page_bytes"] == 16 * 32 + 16 * 4
    if layout == "owner_sharded":
        assert all(sum(o[i] for o in owned) == 1 for i in range(n))  # exactly one owner per token
        rep = res[0]["report"]
        assert rep["bytes_per_rank"] * world == rep["replicated_bytes_per_rank"]
        assert rep["physical_tokens_per_rank"] * world == rep["logical_tokens"]
        assert rep["bytes_saved_per_rank"] == rep["replicated_bytes_per_rank"] - rep["bytes_per_rank"]
    else:
        assert all(all(o) for o in owned)
        assert res[0]["report"]["fraction_of_replicated"] == 1.0


def test_default_page_geometry(pools):
    res = pools(2).run(fns.pipeline, 16, 128, 64, 1, 3)
    for r in res:
        assert r["bytes"] == (8 * 8448, 16 * 8448)  # 1/W of replicated, SGLang's 8448 B pages
        assert r["fraction"] == 0.5


@pytest.mark.parametrize(
    "world,interleave,upcast,lens",
    [(2, 1, False, torch.int64), (3, 64, False, torch.int32), (2, 64, True, torch.int64)],
)
def test_scoring_kernel_against_reference(pools, world, interleave, upcast, lens):
    res = pools(world).run(fns.scoring, 16, 64, 64, interleave, 21, upcast=upcast, lens_dtype=lens)
    for r in res:
        for lay in ("owner_sharded", "replicated"):
            assert r[lay]["values"] and r[lay]["mask"], r
        if not upcast:  # the interpreter's exact fp64 dot is position-independent; its fp32 BLAS is not
            assert r["bitwise_vs_replicated"] and r["no_table"], r
        assert r["narrow_table"], r


@pytest.mark.parametrize("world,interleave", [(2, 64), (4, 1)])
def test_sharded_pipeline_selects_what_replicated_selects(pools, world, interleave):
    res = pools(world).run(fns.pipeline, 16, 64, 32, interleave, 5)
    for r in res:
        assert r["equal_baseline"] and r["equal_reference"], r
    assert len({r["digest"] for r in res}) == 1


def test_reference_ownership_and_quantization():
    for W in (1, 2, 3, 4, 8):
        for I in (1, 3, 64):
            g = torch.arange(5 * W * I + 7)
            o, l = ref.owner(g, W, I), ref.local_row(g, W, I)
            for r in range(W):
                mine = g[o == r]
                assert torch.equal(ref.global_id(l[o == r], r, W, I), mine)
                assert torch.equal(l[o == r], torch.arange(mine.numel()))  # dense local rows
                for L in (0, 1, I, W * I + 1, g.numel()):
                    assert ref.local_length(L, r, W, I) == int((mine < L).sum())
    k = torch.randn(64, 128) * torch.logspace(-6, 4, 64)[:, None]
    k[0] = 0.0
    k[1, 0] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two: no rounding up
    k[2, 0] = 448.0 * 2.0**-3 * (1 + 2.0**-20)
    q, s = ref.quantize_k(k)
    amax = k.abs().amax(1).clamp_min(1e-4)
    e = torch.tensor([__import__("math").ceil(__import__("math").log2(float(a) / 448.0)) for a in amax.double()])
    assert torch.equal(s.double().log2(), e.double())  # powers of two with the exact exponent
    assert float(s[1]) == 2.0**-3 and float(s[2]) == 2.0**-2
    assert bool((q.float().abs() <= 448).all())
    err = (q.float() * s[:, None] - k).abs()
    assert bool((err <= s[:, None] * 16 + 1e-30).all())  # e4m3 half-ulp at most 16 below 448


def test_reference_canonical_order_and_keys():
    s = torch.tensor([1.0, float("nan"), -0.0, 0.0, 2.0, float("-inf"), 2.0, float("inf"), -1.0, 0.0])
    order = ref.canonical_order(s, torch.arange(s.numel()))
    assert order == [7, 4, 6, 0, 2, 3, 9, 8, 5, 1]
    keys = ref.pack_keys(s, torch.arange(s.numel()))
    assert torch.argsort(keys, descending=True).tolist() == order
    assert bool((keys >= 1).all())
    g = torch.Generator().manual_seed(0)
    x = fns.tie_logits(1, 3000, 1)[0]
    ids = torch.randperm(3000, generator=g)
    assert torch.argsort(ref.pack_keys(x, ids), descending=True).tolist() == [
        ids.tolist().index(i) for i in ref.canonical_order(x, ids)
    ]


def test_cuda_scan_backend_rule():
    """ "auto" takes the CUDA scan at every row count with <= 32 heads and from 3 query rows on with more (the choice
    never looks at the cache's layout, so both layouts of the same rows take the same kernel); "cuda" / "triton"
    force it; one int for ``cuda_scan_min_rows`` holds for both head tiles."""
    from dataclasses import replace

    from peerdcp.topk import policy as pol

    wanted = pol.cuda_scan_wanted
    assert [wanted(r, 32) for r in (1, 2, 3)] == [True, True, True]
    assert [wanted(r, 64) for r in (1, 2, 3, 128)] == [False, False, True, True]
    assert wanted(1, 8) and not wanted(2, 33)
    p = replace(pol.DEFAULT_POLICY, cuda_scan_min_rows=4)
    assert [wanted(r, h, policy=p) for r in (3, 4) for h in (32, 64)] == [False, False, True, True]
    for backend, want in (("cuda", True), ("triton", False)):
        p = replace(pol.DEFAULT_POLICY, scan_backend=backend)
        assert all(wanted(r, h, policy=p) is want for r in (1, 4) for h in (32, 64))


def test_scan_npage_policy():
    """``_scan_npage`` follows its documented rule (checked against a brute-force reading of the rule for every
    shape of a grid), always returns a candidate, and with the 1 / 4 / 16-page settings reproduces the ladder loop
    that multiplies the pages by 4 while 8 programs per SM remain."""
    from dataclasses import asdict, replace

    from peerdcp.topk import policy as pol

    def rule(T, pages, sms, group, t):
        cands = sorted(n * group for n in t["scan_npages"])
        wave = sorted(n * group for n in t["scan_wave_npages"])

        def progs(n):
            return T * -(-pages // n)

        ok = [n for n in cands[2:] if progs(n) >= t["scan_min_programs_per_sm"] * sms]
        if ok:
            return max(ok)
        if len(cands) > 1 and progs(cands[1]) >= t["scan_min_programs_per_sm_small"] * sms:
            slots = t["scan_resident_per_sm"] * sms
            if wave and progs(wave[0]) > slots:  # brute force: every candidate's whole waves x pages
                costs = {n: -(-progs(n) // slots) * n for n in wave}
                return max(n for n in wave if costs[n] == min(costs.values()))
            return cands[1]
        return cands[0]

    def ladder(T, pages, sms, group):
        npage = group
        while npage < 16 * group and T * -(-pages // (npage * 4)) >= 8 * sms:
            npage *= 4
        return npage

    shapes = [(T, p, s, g) for T in (1, 2, 3, 8, 33, 128) for p in (1, 5, 64, 256, 1024, 2048) for s in (1, 78, 132)
              for g in (1, 2)]  # fmt: skip
    t = asdict(pol.DEFAULT_POLICY)
    for T, p, s, g in shapes:
        got = pol.scan_npage(T, p, s, g)
        want = rule(T, p, s, g, t)
        assert got == want and got in [n * g for n in (*t["scan_npages"], *t["scan_wave_npages"])], (T, p, s, g, got)
    old = {"scan_npages": (1, 4, 16), "scan_min_programs_per_sm": 8, "scan_min_programs_per_sm_small": 8}
    ladder_policy = replace(pol.DEFAULT_POLICY, **old, scan_wave_npages=())
    assert all(pol.scan_npage(*x, policy=ladder_policy) == ladder(*x) for x in shapes)
    # the benchmark's shapes on H200 (132 SMs): (rows, pages) -> pages per program. With the register cap (8
    # resident per SM): 8 pages at every mid size, 2 at 8 x 512 - at 8 and 32 rows the fastest of 2 and 4-16.
    # Uncapped (7 resident per SM), the wave-fill rule with 7 and 9 among its candidates: 32 rows x 256 pages (32K
    # sharded) 10, 32 x 512 (32K replicated) 9, 64 x 256 6, 8 x 1024 (128K sharded) 9, 8 x 2048 9, 8 x 512 (32K
    # replicated) 5.
    shapes = ((1, 512), (8, 256), (1, 1024), (64, 512), (32, 1024), (32, 256), (32, 512), (64, 256), (8, 1024),
              (8, 2048), (8, 512))  # fmt: skip
    assert [pol.scan_npage(T, p, 132, 1) for T, p in shapes] == [1, 2, 2, 8, 8, 8, 8, 8, 8, 8, 2]
    uncapped = replace(pol.DEFAULT_POLICY, scan_resident_per_sm=7)  # the uncapped kernel
    assert [pol.scan_npage(T, p, 132, 1, policy=uncapped) for T, p in shapes] == [1, 2, 2, 8, 8, 10, 9, 6, 9, 9, 5]


def test_merge_pdl_rule():
    """``TopK.select``'s merge launches with PDL ("auto") only while the selection's CTAs and the merge's fit on the
    SMs together (merge CTAs one per SM after clustered selections, as many as an SM holds after one-CTA ones); a
    bool in ``TopKPolicy.select_merge_pdl`` forces it either way."""
    from dataclasses import replace
    from unittest import mock

    from peerdcp.topk import ops
    from peerdcp.topk import policy as pol

    resident = {8: 16, 4: 33, 2: 66}  # clusters of each size resident at once (made up)
    with (
        mock.patch.object(ops, "max_select_clusters", lambda c, device: resident[c]),
        mock.patch.object(ops, "max_keys", lambda device: 29056),  # H200's 227 KiB of shared memory, in keys
        mock.patch.object(pol, "num_sms", lambda device: 132),
    ):
        # W = 2, k = 2048: the merge takes 8 CTAs per row (place-all); rows of 16K scores a cluster of 8 per row
        # up to 16 rows: 1 row 8 + 8 CTAs, 8 rows 64 + 64 (fits), 16 rows 128 + 128 (does not)
        assert [pol.merge_pdl(T, 2, 2048, 0, 16384) for T in (1, 2, 8, 16, 32, 128)] == [True] * 3 + [False] * 3
        # W = 4: 16 merge CTAs per row: 4 rows 32 + 64 fit, 8 rows 64 + 128 do not
        assert [pol.merge_pdl(T, 4, 2048, 0, 65536) for T in (1, 4, 8)] == [True, True, False]
        # rows of <= 4096 scores take one selection CTA, and the merge's CTAs count two to an SM (shared memory
        # allows it up to W * k = 14528 keys): W = 2, 8 per row, 26 rows 26 + 104 / 2 SMs fit, 27 rows 27 + 108 / 2 do
        # not; W = 4, 16 per row, 14 rows 14 + 224 / 2 fit, 15 rows 15 + 240 / 2 do not
        assert [pol.merge_pdl(T, 2, 2048, 0, 4096) for T in (14, 15, 26, 27)] == [True, True, True, False]
        assert [pol.merge_pdl(T, 4, 2048, 0, 4096) for T in (8, 14, 15)] == [True, True, False]
        # W = 8: one merge CTA per SM (16384 keys take over half): 4 rows 4 + 4 * 32 fit, 5 rows 5 + 5 * 26 do not
        assert pol.merge_ctas_per_sm(8, 2048, 0) == 1 and pol.merge_ctas_per_sm(4, 2048, 0) == 2
        assert [pol.merge_pdl(T, 8, 2048, 0, 4096) for T in (4, 5)] == [True, False]
        # the merge's grid passed in (TopK.select computes it once for the rule and the launch) decides alike
        for T, W, length in ((8, 2, 16384), (16, 2, 16384), (4, 4, 65536), (8, 4, 65536), (14, 2, 4096)):
            g = pol.grid(T, W, 2048, 0)
            assert pol.merge_pdl(T, W, 2048, 0, length, launch_grid=g) == pol.merge_pdl(T, W, 2048, 0, length)
        assert pol.merge_pdl(8, 2, 2048, 0, 16384, launch_grid=(9, 1)) is False  # 64 + 72 CTAs: from the grid given
        for forced in (True, False):
            p = replace(pol.DEFAULT_POLICY, select_merge_pdl=forced)
            assert pol.merge_pdl(1, 2, 2048, 0, 16384, policy=p) is forced
            assert pol.merge_pdl(128, 4, 2048, 0, 16384, policy=p) is forced


def test_select_ctas_rule():
    """CTAs per row of the CUDA selection: the largest of 8, 4, 2 whose clusters are all resident at once (the
    occupancy query; -1, a failed query, never qualifies) if it spares each CTA more than 8192 of the row's scores,
    else 1; a forced ``TopKPolicy.select_ctas`` is clamped to 1 .. 8."""
    from dataclasses import replace
    from unittest import mock

    from peerdcp.topk import ops
    from peerdcp.topk import policy as pol

    resident = {8: 14, 4: 30, 2: 64}  # clusters of each size resident at once (made up)
    with mock.patch.object(ops, "max_select_clusters", lambda c, device: resident[c]):
        got = [pol.select_ctas(rows, 0) for rows in (0, 1, 14, 15, 30, 31, 64, 65, 512)]
        assert got == [8, 8, 8, 4, 4, 2, 2, 1, 1]
        got = [pol.select_ctas(1, 0, length) for length in (1, 4096, 8192, 9362, 9363, 131072)]
        assert got == [1, 1, 1, 1, 8, 8]  # C = 8 spares 7/8 of the row: more than 8192 from 9363 scores on
        got = [pol.select_ctas(15, 0, length) for length in (10922, 10923, 131072)]
        assert got == [1, 4, 4]  # C = 4 (15 rows): 3/4 of the row
        got = [pol.select_ctas(31, 0, length) for length in (16384, 16385, 131072)]
        assert got == [1, 2, 2]  # C = 2 (31 rows): half the row
        assert pol.select_ctas(65, 0, 131072) == 1  # no cluster size resident for 65 rows
    with mock.patch.object(ops, "max_select_clusters", lambda c, device: -1):
        assert pol.select_ctas(1, 0) == 1
    with mock.patch.object(ops, "max_select_clusters", lambda c, device: resident[c]):
        assert pol.select_ctas(1, 0, policy=replace(pol.DEFAULT_POLICY, select_ctas=3)) == 3
        assert pol.select_ctas(1000, 0, policy=replace(pol.DEFAULT_POLICY, select_ctas=99)) == 8


def test_audit_inputs_raise(pools):
    """Inputs that the checks must refuse: past them they give wrong ids / scores or fail late."""
    for r in pools(2).run(fns.audit_inputs):
        table = r.pop("aligned table")
        for name, msg in r.items():
            assert msg.startswith(("ValueError", "TypeError")), (name, msg)
        assert "contiguous" in r["select column lens"] and "contiguous" in r["indexer_logits column lens"], r
        assert "contiguous" in r["canonical_topk column lens"], r
        assert "seq_align" in r["block_table start off alignment"], r
        assert table.startswith("[["), table


@pytest.mark.nvcc
def test_c_entry_points_refuse_a_parameter_block_of_another_size():
    """Every Top-K launch entry point takes its parameter block and its size: a block of another size or none is
    refused with cudaErrorInvalidValue (1) before anything touches CUDA, bad geometry too, and T = 0 launches
    nothing. ``load`` / ``load_score`` checked the C sizes against the ctypes mirrors."""
    import ctypes

    from peerdcp.topk import ops

    invalid = 1
    merge, select = ops.TopkMergeParams(), ops.TopkSelectParams()
    merge.W, merge.K, merge.T, merge.ctas_per_row = 2, 8, 0, 1
    select.n, select.Lmax, select.T, select.W, select.I, select.ctas = 8, 64, 0, 2, 1, 1
    score = ops.TopkScoreParams()
    score.H, score.W, score.I, score.npage, score.min_ctas, score.num_pages = 64, 2, 1, 1, 6, 1
    cases = (
        (ops.load().peerdcp_topk_merge, merge),
        (ops.load().peerdcp_topk_select, select),
        (ops.load_score().peerdcp_topk_score, score),
    )
    for entry, p in cases:
        size = ctypes.sizeof(p)
        assert entry(ctypes.byref(p), size - 8, None) == invalid
        assert entry(ctypes.byref(p), size + 8, None) == invalid
        assert entry(None, size, None) == invalid
        assert entry(ctypes.byref(p), size, None) == 0  # T = 0: no launch
    merge.W = 9
    select.ctas = 9
    score.min_ctas = 5  # no such instance
    for entry, p in cases:
        assert entry(ctypes.byref(p), ctypes.sizeof(p), None) == invalid
