"""Indexer / Top-K benchmark (DESIGN.md sections 8-9): ``python -m bench.topk [--quick] [--out DIR]``.

Part 1 - the merge alone (top-k 2048, rows 1 ... 512): every rank holds its local canonical candidates
(``int64 [rows, 2048]`` packed keys, as ``TopK.local_candidates`` makes them) and needs the exact global
top-k:

* ``direct``     - ``TopK.merge`` over peer memory (publish kernel + merge kernel; ``merge`` column: the
  kernel ``merge_impl="auto"`` chose, CUDA C++ on a GPU);
* ``direct_triton`` - the same with the Triton merge kernel (the twin);
* ``allgather``  - ``TopK`` with ``backend="allgather"``: NCCL all-gather of the candidates + the same merge;
* ``baseline``   - the DESIGN.md section 9 baseline: NCCL all-gather of the candidates + ``torch.topk`` on
  the unique int64 keys (+ id extraction). Target: ``direct`` >= 4x faster at every row count.

Part 2 - the indexer pipeline at 32K and 128K context, DeepSeek-V3.2 (64 indexer heads x 128) and GLM-5
(32 heads), rows 1 ... 128 (one sequence per row, paged; ``--contexts`` / ``--index-rows`` choose others, e.g. 16K
context and 16-26 rows, where one-CTA selections take the merge by PDL):

* ``rep_score`` / ``rep_pipe`` - replicated index-K: full scan (``indexer_logits``), then ``canonical_topk``;
* ``sh_score`` / ``sh_pipe``   - owner-sharded: local scan, then ``TopK.select`` (local top-k + merge; on a GPU
  the selection kernel publishes the candidates itself, so no publish kernel runs there, unlike Part 1; the merge
  launches with PDL where ``policy.merge_pdl``'s rule says so).
  ``--publish-paths`` adds ``sh_pipe_kernel`` (the publish kernel instead: ``select_publish`` off) and
  ``sh_pipe_pdl`` (the merge always launched with PDL: ``select_merge_pdl`` True), timed in the same process.
  Targets: ``sh_score <= 1.1/W * rep_score``; index-K bytes per rank = 1/W of replicated.
* ``empty``  - a one-program Triton kernel that stores one value, timed the same way: the per-call floor of
  any kernel in this harness, which both scans pay (with the bytes each reads, it bounds the ratio a
  latency-bound call can reach).

Part 3 (``--local``) - the local candidate stage alone (``TopK.local_candidates``: this rank's top 2048 of its
scores as sorted canonical keys), rows 1 ... 128 x local lengths 4K ... 128K, random scores: ``cuda`` - the
selection kernel (``csrc/topk/select.cu``: keys from scores, radix select, shared-memory sort) with its rule's
``ctas`` CTAs per row (a thread-block cluster at few rows), ``cuda_1cta`` - the same kernel with one CTA per row,
vs ``torch`` - the Triton keys kernel + ``torch.topk`` (what the stage ran before, and still runs above 2048
candidates or without nvcc); ``speedup`` = torch / cuda. Local, so one GPU runs it (``--world 1 --no-merge
--no-indexer --local``). ``--local-force F,L`` force-includes each row's first F and last L tokens (scored +inf).
``--local-scores indexer`` takes part 2's indexer scores (``Σ_h w_h · ReLU(q_h · k_s) · scale_s`` over random FP8 key
bytes with power-of-two scales, 64 heads) instead of normal ones: a few far outliers, which the selection's bucket
pass handled by its slow fallback.

Every timing is the median over replays of the slowest rank, CUDA graphs (``--eager`` adds eager runs);
the selection of every compared path is checked for equality first (column ``exact``). Prints the tables
last; writes ``topk.json``, ``topk_merge.png`` and ``topk_indexer.png`` into ``--out``.

Peers (``bench.peers.topk``): vLLM 0.34.0's all-gather merge and direct Top-K end in CuTeDSL selects that do not
run here, so neither is timed; on a GPU the report checks their Triton pack (top-k 2048) and push and says why
each select is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import torch

from bench.common import add_common_args, header, plot_series, run_ranks, slowest_rank, time_op

K = 2048
MODELS = {"DeepSeek-V3.2": 64, "GLM-5": 32}


def _ids_from_keys(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 0, 0x7FFFFFFF - (v & 0x7FFFFFFF), torch.full_like(v, -1)).to(torch.int32)


def _device(cfg: dict) -> torch.device:
    if cfg["device"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _time(cfg: dict, fn, *, graph: bool = True) -> float:
    """Median µs per call of the slowest rank (CUDA graph unless ``graph=False``); wall clock on CPU."""
    if cfg["device"] == "cuda":
        us = time_op(fn, graph=graph, calls=cfg["calls"], iters=cfg["iters"], lead_us=cfg.get("lead_us", 100.0))
        return slowest_rank(us).median
    import torch.distributed as dist

    t0 = time.perf_counter()
    for i in range(cfg["calls"]):
        fn(i)
    us = [(time.perf_counter() - t0) * 1e6 / cfg["calls"]]
    dist.barrier()
    return slowest_rank(us).median


def allgather_topk(keys: torch.Tensor, W: int, group=None) -> torch.Tensor:
    """Baseline: NCCL all-gather of ``keys [T, K]`` + ``torch.topk`` over the ``W*K`` unique keys."""
    import torch.distributed as dist

    T = keys.shape[0]
    g = torch.empty(W * T, K, dtype=torch.int64, device=keys.device)
    dist.all_gather_into_tensor(g, keys, group=group)
    cand = g.view(W, T, K).transpose(0, 1).reshape(T, W * K)
    return _ids_from_keys(torch.topk(cand, K, dim=1, largest=True, sorted=True).values)


# ----------------------------------------------------------------------------------------- part 1
def merge_rank(cfg: dict) -> list[dict]:
    import torch.distributed as dist

    import peerdcp
    from peerdcp.topk.policy import DEFAULT_POLICY

    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(cfg)
    out = []
    max_rows = max(cfg["rows"])
    with (
        peerdcp.TopK(max_rows=max_rows, topk=K, backend="direct", device=dev) as tkd,
        peerdcp.TopK(max_rows=max_rows, topk=K, backend="direct", device=dev, merge_impl="triton") as tkt,
        peerdcp.TopK(max_rows=max_rows, topk=K, backend="allgather", device=dev) as tka,
    ):
        for T in cfg["rows"]:
            g = torch.Generator(device=dev).manual_seed(1000 * T + r)
            lloc = 2 * K  # every rank has more than K tokens: K valid candidates each
            lens = torch.full((T,), W * lloc, dtype=torch.int64, device=dev)
            sets = []
            for _ in range(4):
                logits = torch.randn(T, lloc, generator=g, device=dev)
                logits = torch.round(logits * 8) / 8  # ties, as FP8 scores have
                sets.append(tkd.local_candidates(logits, lens))
            exact = all(
                torch.equal(tkd.merge(s), allgather_topk(s, W))
                and torch.equal(tka.merge(s), tkd.merge(s))
                and torch.equal(tkt.merge(s), tkd.merge(s))
                for s in sets
            )
            for c in cfg.get("merge_ctas") or []:  # every forced CTA count gives the same ids
                tkc = tkd._with_policy(dataclasses.replace(DEFAULT_POLICY, cuda_merge_ctas_per_row=c))
                exact = exact and all(torch.equal(tkc.merge(s), allgather_topk(s, W)) for s in sets)
            row = {"rows": T, "exact": exact, "memory": tkd.memory, "merge": tkd.merge_impl}
            ops = {
                "direct": lambda i: tkd.merge(sets[i % 4]),
                "direct_triton": lambda i: tkt.merge(sets[i % 4]),
                "allgather": lambda i: tka.merge(sets[i % 4]),
                "baseline": lambda i: allgather_topk(sets[i % 4], W),
            }
            if cfg.get("breakdown"):
                # the direct merge's two kernels alone: publish (no wait) and merge (flags of the current
                # epoch already set by the last publish, so its wait passes at once); both ranks make the
                # same number of publishes, so the epochs stay in step for the calls that follow
                scratch = torch.empty(T, K, dtype=torch.int32, device=dev)
                ops["publish_only"] = lambda i: tkd._publish(sets[i % 4], scratch)
                ops["merge_only"] = lambda i: tkd._merge_inbox(sets[i % 4], scratch)
                for c in cfg.get("merge_ctas") or []:  # the CUDA merge with c CTAs per row (captured so)
                    ops[f"merge_c{c}"] = functools.partial(_merge_with_ctas, tkd, sets, scratch, c)
            for name, fn in ops.items():
                row[name] = _time(cfg, fn)
                if cfg["eager"]:
                    row[name + "_eager"] = _time(cfg, fn, graph=False)
            row["speedup"] = row["baseline"] / row["direct"]
            row["vs_allgather"] = row["allgather"] / row["direct"]
            out.append(row)
        tkd.check()
        tkt.check()
    return out if r == 0 else []


def _merge_with_ctas(tk, sets: list, scratch: torch.Tensor, ctas: int, i: int) -> None:
    tk._merge_inbox(sets[i % 4], scratch, launch_grid=(ctas, 0))  # the cut-off mode with ctas CTAs per row


# ----------------------------------------------------------------------------------------- part 2
def _random_keys(n: int, gen: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random FP8 keys (no NaN bytes) and power-of-two scales."""
    data = torch.randint(0, 256, (n, 128), generator=gen, device=dev, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] -= 1  # 0x7F / 0xFF are NaN in e4m3fn
    scales = torch.exp2(torch.randint(-9, -3, (n,), generator=gen, device=dev).float())
    return data.view(torch.float8_e4m3fn), scales


def _random_queries(T: int, H: int, gen: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``T`` random indexer query rows: FP8 queries ``[T, H, 128]`` (N(0, 4) before the cast) and fp32 head
    weights ``[T, H]`` (N(0, 1 / (128 H)), the query scale folded in)."""
    q = (torch.randn(T, H, 128, generator=gen, device=dev) * 2).to(torch.float8_e4m3fn)
    return q, torch.randn(T, H, generator=gen, device=dev) * H**-0.5 * 128**-0.5


def indexer_case(ctx: int, T: int, H: int, W: int, gen: torch.Generator, dev: torch.device):
    """One indexer case: T rows of one ``ctx``-token sequence each (the same random keys in a replicated and an
    owner-sharded ``IndexKCache``), rotated over ``nsets`` input sets while they are small enough to stay in
    L2 otherwise (large cases stream from HBM anyway).

    Returns ``(caches, q, w, lens, nsets)``: ``caches[layout] = (cache, block_tables, span)`` with one block
    table per set, ``q`` / ``w`` one FP8 query ``[T, H, 128]`` / fp32 weight ``[T, H]`` per set (the same on every
    rank), ``lens`` ``[T]`` int64.
    """
    import peerdcp

    nsets = 4 if T * ctx * 132 < (256 << 20) else 1
    nseq = nsets * T
    caches = {}
    for lay in ("replicated", "owner_sharded"):
        # one sequence per row, each starting on an aligned logical slot (IndexKCache.seq_align)
        align = 64 * W if lay == "owner_sharded" else 64
        span = -(-ctx // align) * align
        c = peerdcp.IndexKCache(capacity_tokens=nseq * span, layout=lay, device=dev)
        npg = -(-(ctx if lay == "replicated" else -(-ctx // W)) // c.page_size)
        starts = torch.arange(nseq, device=dev, dtype=torch.int64).view(nsets, T) * span
        caches[lay] = (c, [c.block_table(starts[j], npg) for j in range(nsets)], span)
    for i in range(nseq):  # the same tokens into both caches (sharded keeps its own)
        k8, ks = _random_keys(ctx, gen, dev)
        for c, _, span in caches.values():
            c.write(i * span + torch.arange(ctx, device=dev), k8, ks)
    q0, w0 = _random_queries(T, H, gen, dev)
    q, w = [q0], [w0]
    for _ in range(nsets - 1):
        q.append(q[0][torch.randperm(T, generator=gen, device=dev)])  # same on every rank
        w.append(w[0].flip(1).contiguous())
    lens = torch.full((T,), ctx, dtype=torch.int64, device=dev)
    return caches, q, w, lens, nsets


def indexer_rank(cfg: dict) -> list[dict]:
    import torch.distributed as dist

    import peerdcp
    from peerdcp.topk import canonical_topk, indexer_logits

    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(cfg)
    out = []
    tk = peerdcp.TopK(max_rows=max(cfg["index_rows"]), topk=K, device=dev)
    empty = None  # (CPU: no kernel floor to time)
    if dev.type == "cuda":
        from bench.floor import empty_kernel

        flag = torch.zeros(1, device=dev)
        empty = _time(cfg, lambda i: empty_kernel[(1,)](flag))
    try:
        for model, H in MODELS.items():
            for ctx in cfg["contexts"]:
                for T in cfg["index_rows"]:
                    gen = torch.Generator(device=dev).manual_seed(ctx + T + H)
                    caches, q, w, lens, nsets = indexer_case(ctx, T, H, W, gen, dev)
                    (rc, rtab, _), (sc, stab, _) = caches["replicated"], caches["owner_sharded"]

                    def rep_score(i, rc=rc, rtab=rtab, q=q, w=w, lens=lens, ctx=ctx, n=nsets):
                        j = i % n
                        return indexer_logits(q[j], w[j], rc, lens, block_table=rtab[j], max_seq_len=ctx)

                    def sh_score(i, sc=sc, stab=stab, q=q, w=w, lens=lens, ctx=ctx, n=nsets):
                        j = i % n
                        return indexer_logits(q[j], w[j], sc, lens, block_table=stab[j], max_seq_len=ctx)

                    def rep_pipe(i, lens=lens, rep_score=rep_score):
                        return canonical_topk(rep_score(i), lens, K)

                    def sh_pipe(i, lens=lens, sh_score=sh_score):
                        return tk.select(sh_score(i), lens)

                    exact = all(torch.equal(rep_pipe(j), sh_pipe(j)) for j in range(nsets))
                    row = {"model": model, "ctx": ctx, "rows": T, "exact": exact}
                    for name, fn in (
                        ("rep_score", rep_score),
                        ("sh_score", sh_score),
                        ("rep_pipe", rep_pipe),
                        ("sh_pipe", sh_pipe),
                    ):
                        row[name] = _time(cfg, fn)
                    if cfg.get("publish_paths"):  # TopK.select's other paths, timed for RESULTS.md
                        from peerdcp.topk.policy import DEFAULT_POLICY

                        for name, tune in (
                            ("sh_pipe_kernel", {"select_publish": False}),
                            ("sh_pipe_pdl", {"select_merge_pdl": True}),
                        ):
                            tkp = tk._with_policy(dataclasses.replace(DEFAULT_POLICY, **tune))

                            def path_pipe(i, lens=lens, sh_score=sh_score, tkp=tkp):
                                return tkp.select(sh_score(i), lens)

                            row["exact"] = row["exact"] and all(
                                torch.equal(rep_pipe(j), path_pipe(j)) for j in range(nsets)
                            )
                            row[name] = _time(cfg, path_pipe)
                    row["empty"] = empty
                    row["score_ratio"] = row["sh_score"] / row["rep_score"]
                    row["score_target"] = 1.1 / W
                    row["pipe_speedup"] = row["rep_pipe"] / row["sh_pipe"]
                    row["bytes_rep_MB"] = rc.nbytes / 2**20
                    row["bytes_sh_MB"] = sc.nbytes / 2**20
                    row["bytes_ratio"] = sc.nbytes / rc.nbytes
                    out.append(row)
                    rc.close()
                    sc.close()
                    del caches, rtab, stab
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
        tk.check()
    finally:
        tk.close()
    return out if r == 0 else []


def _local_scores(kind: str, T: int, L: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``[T, L]`` fp32 scores for part 3: ``normal``, or ``indexer`` (part 2's scores of T random queries over L
    random keys, 64 heads, by ``reference.index_scores``; one row at a time, so the ``[64, L]`` fp64 head
    products stay small)."""
    if kind == "normal":
        return torch.randn(T, L, generator=gen, device=dev)
    from peerdcp.topk.reference import index_scores

    k8, ks = _random_keys(L, gen, dev)
    return torch.cat([index_scores(*_random_queries(1, 64, gen, dev), k8, ks) for _ in range(T)])


def local_rank(cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from peerdcp.topk import policy as pol
    from peerdcp.topk.candidates import _local_keys

    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(cfg)
    out, kind = [], cfg.get("local_scores", "normal")
    for Lloc in cfg["local_lengths"]:
        for T in cfg["local_rows"]:
            gen = torch.Generator(device=dev).manual_seed(Lloc + T)
            nsets = 4 if T * Lloc * 4 < (64 << 20) else 1  # rotate inputs while they would stay in L2
            logits = [_local_scores(kind, T, Lloc, gen, dev) for _ in range(nsets)]
            lens = torch.full((T,), Lloc * W, dtype=torch.int64, device=dev)  # this rank owns Lloc of them

            def fn(i, logits=logits, lens=lens, n=nsets, policy=None):
                force = cfg.get("local_force", (0, 0))
                return _local_keys(logits[i % n], lens, K, r, W, 1, *force, policy=policy)

            torch_fn = functools.partial(fn, policy=dataclasses.replace(pol.DEFAULT_POLICY, local_select="torch"))
            want = [torch_fn(j) for j in range(nsets)]
            t_torch = _time(cfg, torch_fn)
            exact = all(torch.equal(fn(j), want[j]) for j in range(nsets))
            t_cuda = _time(cfg, fn)
            ctas, t_one = 1, t_cuda
            if dev.type == "cuda":  # the same kernel with one CTA per row (the rule's choice before clusters)
                ctas = pol.select_ctas(T, dev.index, Lloc)
                one_fn = functools.partial(fn, policy=dataclasses.replace(pol.DEFAULT_POLICY, select_ctas=1))
                exact = exact and all(torch.equal(one_fn(j), want[j]) for j in range(nsets))
                t_one = _time(cfg, one_fn)
            out.append(
                {"local_len": Lloc, "rows": T, "exact": exact, "ctas": ctas, "cuda": t_cuda, "cuda_1cta": t_one,
                 "torch": t_torch, "speedup": t_torch / t_cuda}
            )  # fmt: skip
            del logits, want
    return out if r == 0 else []


def rank_main(cfg: dict) -> dict:
    t0 = time.time()
    merge = merge_rank(cfg) if cfg.get("merge", True) else []
    t1 = time.time()
    index = indexer_rank(cfg) if cfg["contexts"] else []
    local = local_rank(cfg) if cfg.get("local_lengths") else []
    return {"merge": merge, "indexer": index, "local": local, "seconds": (t1 - t0, time.time() - t1)}


def _table(rows: list[dict], cols: list[str]) -> str:
    from bench.common import format_table

    return format_table(rows, cols)


def _int_list(v: str) -> list[int]:
    """A comma-separated list of ints (an argparse ``type``)."""
    return [int(x) for x in v.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.topk", description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--eager", action="store_true", help="also time the merge eagerly (no CUDA graph)")
    p.add_argument("--no-indexer", action="store_true", help="skip part 2")
    p.add_argument("--no-merge", action="store_true", help="skip part 1")
    p.add_argument("--local", action="store_true", help="add part 3 (the local candidate stage alone)")
    p.add_argument(
        "--local-force",
        type=lambda v: tuple(_int_list(v)),
        default=(0, 0),
        metavar="FIRST,LAST",
        help="part 3: force-include the first / last this many tokens of each sequence (scored +inf)",
    )
    p.add_argument(
        "--local-scores",
        choices=("normal", "indexer"),
        default="normal",
        help="part 3: normal scores, or part 2's indexer scores over random FP8 keys (far outliers)",
    )
    p.add_argument(
        "--local-rows",
        type=_int_list,
        default=None,
        help="part 3: these row counts (default: 1,2,8,32,64,128; --quick 1,8,32,128)",
    )
    p.add_argument(
        "--local-lengths",
        type=_int_list,
        default=None,
        help="part 3: these local scores per row (default: 4K to 128K)",
    )
    p.add_argument(
        "--index-rows",
        type=_int_list,
        default=None,
        help="part 2: these row counts (default: 1,8,32,64,128; --quick 1,32)",
    )
    p.add_argument(
        "--contexts",
        type=_int_list,
        default=None,
        help="part 2: these context lengths in tokens (default: 32768,131072)",
    )
    p.add_argument(
        "--breakdown", action="store_true", help="also time the direct merge's publish and merge kernels alone"
    )
    p.add_argument(
        "--merge-ctas",
        type=_int_list,
        default=[],
        help="with --breakdown: also time the CUDA merge kernel alone at these CTAs per row (e.g. 1,2,4)",
    )
    p.add_argument(
        "--publish-paths",
        action="store_true",
        help="part 2: also time sh_pipe with the publish kernel (sh_pipe_kernel: select_publish off) and with the "
        "merge always launched by PDL (sh_pipe_pdl: select_merge_pdl True), in the same process",
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="check this script's code paths on CPU (gloo, Triton interpreter, tiny sizes); times mean nothing",
    )
    args = p.parse_args(argv)
    if args.cpu_smoke:
        cfg = {"rows": [1, 3], "index_rows": [2], "contexts": [] if args.no_indexer else [1000], "iters": 1}
        cfg["breakdown"] = args.breakdown
        cfg["publish_paths"] = args.publish_paths
        cfg.update(merge=not args.no_merge, local_rows=[2], local_lengths=[3000] if args.local else [])
        cfg["local_force"], cfg["local_scores"] = args.local_force, args.local_scores
        cfg.update(calls=2, eager=False, device="cpu")
        return _report(_smoke(cfg, args.world or 2), cfg, args, time.time())
    cfg = {
        "rows": [1, 8, 32, 128, 512] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        "index_rows": args.index_rows or ([1, 32] if args.quick else [1, 8, 32, 64, 128]),
        "contexts": [] if args.no_indexer else (args.contexts or [32768, 131072]),
        "merge": not args.no_merge,
        "local_rows": args.local_rows or ([1, 8, 32, 128] if args.quick else [1, 2, 8, 32, 64, 128]),
        "local_force": args.local_force,
        "local_scores": args.local_scores,
        "local_lengths": (
            args.local_lengths
            or ([4096, 16384, 65536, 131072] if args.quick else [4096, 8192, 16384, 32768, 65536, 131072])
        )
        if args.local
        else [],
        "iters": args.iters or (20 if args.quick else 100),
        "calls": args.calls or (10 if args.quick else 20),
        "lead_us": args.lead_us,
        "eager": args.eager,
        "breakdown": args.breakdown,
        "merge_ctas": args.merge_ctas,
        "publish_paths": args.publish_paths,
        "device": "cuda",
    }
    t0 = time.time()
    res = run_ranks("bench.topk:rank_main", args.world, cfg)[0]
    return _report(res, cfg, args, t0)


def _smoke(cfg: dict, world: int) -> dict:
    from peerdcp.harness.launch import RankPool

    with RankPool(world, backend="gloo") as pool:
        return pool.run(rank_main, cfg, timeout=1200)[0]


def _report(res: dict, cfg: dict, args: argparse.Namespace, t0: float) -> int:
    hdr = header()
    from bench import peers

    # vLLM's pack and push are checked here, after the ranks (in the parent, Triton must not be imported before
    # them: see tests/test_bench_smoke.py); on CPU the parent has no interpreter, so only the reasons are listed
    hdr["peers"] = peers.topk_lines("cuda" if cfg["device"] == "cuda" else None)
    hdr["world"] = args.world or 2
    from pathlib import Path

    from bench.common import write_json

    outdir = Path(args.out)
    write_json(outdir / "topk.json", {"header": hdr, "config": cfg, **res})
    merge, index, local = res["merge"], res["indexer"], res.get("local", [])
    if merge:
        xs = [m["rows"] for m in merge]
        series = {n: (xs, [m[n] for m in merge]) for n in ("direct", "allgather", "baseline")}
        plot_series(outdir / "topk_merge.png", series, title="Top-K merge, top-k 2048", xlabel="rows", logy=True)
    if index:
        series = {}
        for model in MODELS:
            for ctx in cfg["contexts"]:
                sel = [x for x in index if x["model"] == model and x["ctx"] == ctx]
                xs = [x["rows"] for x in sel]
                for n in ("rep_pipe", "sh_pipe"):
                    series[f"{model} {ctx // 1024}K {n}"] = (xs, [x[n] for x in sel])
        plot_series(outdir / "topk_indexer.png", series, title="Indexer + Top-K pipeline", xlabel="rows", logy=True)
    print(f"# bench.topk  {hdr.get('gpu', 'no GPU')} x{hdr['world']}  torch {hdr['torch']}  triton {hdr['triton']}")
    print(f"# wall {time.time() - t0:.0f} s (merge {res['seconds'][0]:.0f} s, indexer {res['seconds'][1]:.0f} s)")
    print(f"# json: {outdir / 'topk.json'}")
    print("\n".join(f"# {line}" for line in hdr["peers"]))
    if index:
        print("\nIndexer pipeline (µs; score_ratio target <= score_target; bytes per rank)")
        cols = ["model", "ctx", "rows", "exact", "empty", "rep_score", "sh_score", "score_ratio", "score_target"]
        cols += ["rep_pipe", "sh_pipe", "pipe_speedup", "bytes_rep_MB", "bytes_sh_MB", "bytes_ratio"]
        if cfg.get("publish_paths"):
            cols[cols.index("pipe_speedup") : cols.index("pipe_speedup")] = ["sh_pipe_kernel", "sh_pipe_pdl"]
        print(_table(index, cols))
    if local:
        print(
            f"\nLocal candidates, top 2048 of each row's local scores ({cfg.get('local_scores', 'normal')} scores; "
            "µs, CUDA graph, slowest rank; speedup = torch / cuda)"
        )
        print(_table(local, ["local_len", "rows", "exact", "ctas", "cuda", "cuda_1cta", "torch", "speedup"]))
    if merge:
        print("\nTop-K merge, top-k 2048 (µs, CUDA graph, slowest rank; speedup = baseline / direct, target >= 4)")
        cols = ["rows", "exact", "memory", "merge", "direct", "direct_triton", "allgather", "baseline", "speedup"]
        cols += ["vs_allgather"]
        if any("publish_only" in m for m in merge):
            cols[4:4] = ["publish_only", "merge_only"] + [f"merge_c{c}" for c in cfg.get("merge_ctas") or []]
        if cfg["eager"]:
            cols += ["direct_eager", "baseline_eager"]
        print(_table(merge, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
