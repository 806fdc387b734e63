"""Isolated Query-gather benchmark (DESIGN.md section 8): every backend and kernel variant in one run.

    python -m bench.query --quick          # < 90 s on two H200s: 32 heads/rank, FP8, graph (+ eager for two)
    python -m bench.query                  # heads/rank 16, 32, 64; T 1..512; FP8 and BF16; eager and graph

One process per GPU (W = 2 by default), widened query of nope 512 + rope 64 with the DeepSeek-V3.2 YaRN
table. Variants (each checked byte-for-byte against allgather-fused on the same inputs before it is timed):

* ``direct-<impl>-<exchange>-<memory>``: QueryGather(backend="direct"), impl cuda | triton, exchange
  auto | raw | roped | push, memory vmm | symm;
* ``direct-<impl>-zerocopy-<memory>``: exposed_shard (its ack wait) + gather_exposed (raw exchange;
  ``direct-cuda-zerocopy-auto-vmm``: on an auto object, i.e. the sentinel push's grid);
* ``direct-cuda-auto-vmm-<tuning>``: the CUDA auto exchange with one ``QueryPolicy`` change (passed
  as ``policy=``): ``nopdl`` / ``allpdl``, ``noll`` / ``allll``, ``noll12`` / ``allll12``, ``allll128``,
  ``plain`` (the fenced push at every T), ``allsn`` (the sentinel push at every T) / ``sn`` (above LL) /
  ``nosn`` (the former default), ``sn-p2`` (2 blocks per SM), ``sn-nopdl``, ``sn8`` / ``sn16`` (8- / 16-byte
  stores only), ``sn-whole`` (an SN call launches the object's whole grid; the default cuts it),
  ``sn-u1`` / ``-u2`` / ``-u3`` (ceil(T * H / n) blocks, no floor), ``noearly``, ``p1`` / ``p3`` / ``p4``
  (grid), ``allsn-p4``;
* ``allgather-fused``: pack + NCCL all-gather of the bf16 shards + one fused Triton RoPE/convert kernel;
* ``allgather-torch``: the same all-gather + the plain-torch reference ops;
* ``nccl-ag-only``: the NCCL all-gather of the packed bf16 shards alone (the floor of the collective path);
* ``vllm-fused_q-ag`` (a peer, when scripts/setup_peers.sh has extracted it): vLLM 0.34.0's Triton ``fused_q``
  of this rank's heads (FP8: its packed e4m3 rows; BF16: its rotated rope part beside the nope part), NCCL
  ``all_gather_into_tensor`` and the rank-major reorder (what vLLM's ``all_gather(dim=1)`` does). It is timed only
  when its output is byte-equal to allgather-fused or inside ``widened_query_bounds`` on every rank
  (``bench.peers.fused_q``); otherwise a ``check`` row says it differs.

The summaries' ``best_peer`` is the fastest correct peer at each T (allgather-fused, allgather-torch,
vllm-fused_q-ag) and ``vs_best_peer`` its time over direct_best's.

Timing: ``bench.common.time_op`` (``calls`` back-to-back calls per CUDA graph, device barrier before every
replay, inputs rotated), then the median over replays of the slowest rank. The table printed last is the
target check: 32 heads per rank, FP8, CUDA graphs; the JSON and PNGs go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from bench.common import (
    add_common_args,
    format_table,
    header,
    plot_series,
    run_ranks,
    slowest_rank,
    time_op,
    warm_gpu,
)

TOKENS_FULL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TOKENS_QUICK = [1, 8, 32, 64, 128, 256]
TARGET_SPEEDUP = 3.0
TARGET_T1_US = 6.0


def _variants(quick: bool) -> list[tuple[str, dict]]:
    """(name, QueryGather kwargs + bench flags), in timing order."""
    v: list[tuple[str, dict]] = []
    for memory in ("vmm", "symm"):
        for impl in ("cuda", "triton"):
            for ex in ("auto", "raw", "roped", "push"):
                v.append(
                    (f"direct-{impl}-{ex}-{memory}", dict(backend="direct", memory=memory, impl=impl, exchange=ex))
                )
            v.append(
                (
                    f"direct-{impl}-zerocopy-{memory}",
                    dict(backend="direct", memory=memory, impl=impl, exchange="raw", zerocopy=True),
                )
            )
    # policy variants (QueryPolicy fields changed from the default): PDL never / at every T; each flag-in-data
    # protocol of the push (LL, SN, LL12, LL128) never / at every T; none (the fenced push at every T); the LL push
    # without its early first load; the grid at 1, 3 and 4 blocks per SM
    cu = dict(backend="direct", memory="vmm", impl="cuda")
    big = 1 << 40
    off = {"cuda_ll_max_bytes": 0, "cuda_ll12_max_bytes": 0, "cuda_ll128_max_bytes": 0, "cuda_sn_max_bytes": 0}
    v.append(("direct-cuda-auto-vmm-nopdl", dict(cu, tuning={"cuda_pdl_max_tokens": 0, "cuda_sn_pdl": False})))
    v.append(("direct-cuda-auto-vmm-allpdl", dict(cu, tuning={"cuda_pdl_max_tokens": 1 << 30})))
    v.append(("direct-cuda-auto-vmm-noll", dict(cu, tuning={"cuda_ll_max_bytes": 0})))
    v.append(("direct-cuda-auto-vmm-allll", dict(cu, tuning={"cuda_ll_max_bytes": big})))
    v.append(("direct-cuda-auto-vmm-noll12", dict(cu, tuning={"cuda_ll12_max_bytes": 0})))
    v.append(("direct-cuda-auto-vmm-allll12", dict(cu, tuning=dict(off, cuda_ll12_max_bytes=big))))
    v.append(("direct-cuda-auto-vmm-allll128", dict(cu, tuning=dict(off, cuda_ll128_max_bytes=big))))
    v.append(("direct-cuda-auto-vmm-plain", dict(cu, tuning=off)))
    # the sentinel push (FP8): at every T; above the LL bound (LL12 never reached); the first at 4 blocks / SM
    v.append(("direct-cuda-auto-vmm-allsn", dict(cu, tuning=dict(off, cuda_sn_max_bytes=big))))
    v.append(("direct-cuda-auto-vmm-sn", dict(cu, tuning={"cuda_sn_max_bytes": big})))
    # the former default without SN: FP8 LL up to 16 tokens at 32 heads, LL12 up to 128; BF16 LL12 up to 48
    from peerdcp.query.policy import ByDtype

    ll7 = ByDtype(float8_e4m3fn=16 * 32 * 576, bfloat16=0)
    v.append(("direct-cuda-auto-vmm-nosn", dict(cu, tuning={"cuda_sn_max_bytes": 0, "cuda_ll_max_bytes": ll7})))
    v.append(("direct-cuda-auto-vmm-sn-p2", dict(cu, tuning={"cuda_sn_programs_per_sm": 2})))
    v.append(("direct-cuda-auto-vmm-sn-nopdl", dict(cu, tuning={"cuda_sn_pdl": False})))
    v.append(("direct-cuda-auto-vmm-sn8", dict(cu, tuning={"cuda_sn_wide_min_bytes": big})))  # 8-byte stores only
    v.append(("direct-cuda-auto-vmm-sn16", dict(cu, tuning={"cuda_sn_wide_min_bytes": 0})))  # 16-byte only
    # an SN call's grid: the object's whole grid; ceil(T * H / n) blocks with no floor
    v.append(("direct-cuda-auto-vmm-sn-whole", dict(cu, tuning={"cuda_sn_units_per_block": 0})))
    for n in (1, 2, 3):
        cut = {"cuda_sn_units_per_block": n, "cuda_sn_min_blocks_per_sm": 0}
        v.append((f"direct-cuda-auto-vmm-sn-u{n}", dict(cu, tuning=cut)))
    v.append(("direct-cuda-zerocopy-auto-vmm", dict(cu, exchange="auto", zerocopy=True)))
    v.append(("direct-cuda-auto-vmm-noearly", dict(cu, tuning={"cuda_ll_early": False})))
    # grid size: 1, 3 and 4 blocks per SM (default 2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1
    for n in (1, 3, 4):
        v.append((f"direct-cuda-auto-vmm-p{n}", dict(cu, num_programs=n * sms)))
    v.append(("direct-cuda-auto-vmm-allsn-p4", dict(cu, num_programs=4 * sms, tuning=dict(off, cuda_sn_max_bytes=big))))
    if quick:
        keep = {
            "direct-cuda-auto-vmm",
            "direct-cuda-raw-vmm",
            "direct-cuda-roped-vmm",
            "direct-cuda-push-vmm",
            "direct-triton-auto-vmm",
            "direct-cuda-auto-symm",
            "direct-cuda-zerocopy-vmm",
        }
        v = [x for x in v if x[0] in keep]
    v.append(("allgather-fused", dict(backend="allgather", impl="triton")))
    v.append(("allgather-torch", dict(backend="allgather", impl="torch")))
    v.append(("nccl-ag-only", dict(backend="allgather", impl="triton", ag_only=True)))
    return v


# eager timings (Python launch overhead dominates them) only for these
EAGER_VARIANTS = {
    "direct-cuda-auto-vmm",
    "direct-triton-auto-vmm",
    "direct-cuda-zerocopy-vmm",
    "direct-cuda-auto-symm",
    "allgather-fused",
    "allgather-torch",
    "nccl-ag-only",
    "vllm-fused_q-ag",
}
EAGER_QUICK = {"direct-cuda-auto-vmm", "allgather-fused"}
PEER_FUSED_Q = "vllm-fused_q-ag"
# the other projects' ways to the widened query (best_peer / vs_best_peer); nccl-ag-only is a floor, not a peer
PEER_VARIANTS = ("allgather-fused", "allgather-torch", PEER_FUSED_Q)


def _peer_fused_q(cfg: dict, ctx: dict, T: int, sets: list, ref_out: torch.Tensor) -> list[dict]:
    """vLLM's fused_q + NCCL all-gather on this T: checked against allgather-fused's bytes (then, where any rank
    differs, against ``widened_query_bounds`` over every rank's inputs), timed when it matches."""
    import torch.distributed as dist

    from bench.peers import fused_q as peer

    mod, cs, H, out_dtype, out_name = ctx["mod"], ctx["cs"], ctx["H"], ctx["out_dtype"], ctx["out_name"]
    W, dev, D = dist.get_world_size(), sets[0][0].device, 576
    q_scale = torch.ones(1, dtype=torch.float32, device=dev)
    gathered = torch.empty(W * T * H * D, dtype=out_dtype, device=dev)
    out = torch.empty((T, W * H, D), dtype=out_dtype, device=dev)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.14 renamed it

    def step(i: int) -> None:
        n, p, pos = sets[i % len(sets)]
        shard = peer.rank_rows(mod, n, p, pos, cs, out_dtype, q_scale)
        ag(gathered.view(torch.uint8), shard.view(torch.uint8).reshape(-1))
        out.view(T, W, H, D).copy_(gathered.view(W, T, H, D).transpose(0, 1))

    base = dict(H=H, out=out_name, T=T, variant=PEER_FUSED_Q)
    try:  # a peer that fails to launch (e.g. a Triton without PDL) fails alike on every rank: reported, not timed
        step(0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return [dict(base, mode="check", us=float("nan"), ok=False, check=f"error: {type(e).__name__}: {e}")]
    same = torch.tensor(
        [int(torch.equal(out.view(torch.uint8), ref_out[:, : W * H].contiguous().view(torch.uint8)))], device=dev
    )
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if int(same):
        verdict, detail = "byte-equal", "byte-equal to allgather-fused on every rank"
    else:  # every rank's set-0 inputs, for the bound (collective: every rank takes this branch together)
        n, p, pos = sets[0]
        ns, ps = [torch.empty_like(n) for _ in range(W)], [torch.empty_like(p) for _ in range(W)]
        dist.all_gather(ns, n.contiguous())
        dist.all_gather(ps, p.contiguous())
        verdict, detail = peer.verdict(out, ns, ps, pos, cs, out_dtype)
        flag = torch.tensor([int(verdict != "different")], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not int(flag) and verdict != "different":
            verdict, detail = "different", "inside the bound here, outside it on another rank"
    base["check"] = f"{verdict}: {detail}"
    if verdict == "different":
        return [dict(base, mode="check", us=float("nan"), ok=False)]
    rows = []
    for mode in cfg["modes"]:
        if mode == "eager" and PEER_FUSED_Q not in (EAGER_QUICK if cfg["quick"] else EAGER_VARIANTS):
            continue
        us = time_op(step, graph=mode == "graph", calls=cfg["calls"], iters=cfg["iters"], lead_us=cfg["lead_us"])
        st = slowest_rank(us)
        rows.append(dict(base, mode=mode, us=st.median, p20=st.p20, p80=st.p80, n=st.n, ok=True))
    return rows


def rank_main(cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from peerdcp.query import QueryGather
    from peerdcp.query.allgather import all_gather_into
    from peerdcp.query.policy import default_policy
    from peerdcp.query.rope import cos_sin_cache

    dev = torch.device("cuda", torch.cuda.current_device())
    W, me = dist.get_world_size(), dist.get_rank()
    cs = cos_sin_cache("deepseek-v3.2", device=dev)
    rows: list[dict] = []
    max_T = max(cfg["tokens"])
    from bench.peers import fused_q as peer_fq

    peer_mod = None
    if not cfg.get("variants") or PEER_FUSED_Q in cfg["variants"]:
        peer_mod, _ = peer_fq.load()  # every rank loads the same extracted file: all time it or none
    for H in cfg["heads"]:
        for out_name in cfg["dtypes"]:
            out_dtype = torch.float8_e4m3fn if out_name == "fp8" else torch.bfloat16
            objs: dict[str, tuple[QueryGather, dict]] = {}
            for name, kw in _variants(cfg["quick"]):
                if cfg.get("variants") and name not in cfg["variants"] and name != "allgather-fused":
                    continue
                kw = dict(kw)
                flags = {k: kw.pop(k) for k in ("zerocopy", "ag_only", "tuning") if k in kw}
                t0 = time.time()
                policy = dataclasses.replace(default_policy(), **flags.get("tuning", {}))
                qg = QueryGather(max_tokens=max_T, heads_per_rank=H, out_dtype=out_dtype, **kw, policy=policy)
                objs[name] = (qg, flags)
                if me == 0 and cfg["verbose"]:
                    print(f"[H={H} {out_name}] {name}: {objs[name][0].reason} ({time.time() - t0:.1f}s)", flush=True)
            for T in cfg["tokens"]:
                warm_gpu()  # every T starts at working clocks (else the first T is timed cold)
                g = torch.Generator(device=dev).manual_seed(1000 * me + T)
                # positions are the same on every rank (DCP: every rank decodes the same tokens); the
                # "roped" and "push" exchanges rotate each row with its producer's positions, so per-rank positions
                # would make it differ from allgather for a reason that cannot happen in serving.
                gp = torch.Generator(device=dev).manual_seed(7919 + T)
                sets = [
                    (
                        torch.randn(T, H, 512, device=dev, generator=g).to(torch.bfloat16),
                        torch.randn(T, H, 64, device=dev, generator=g).to(torch.bfloat16),
                        torch.randint(0, cs.shape[0], (T,), device=dev, generator=gp),
                    )
                    for _ in range(cfg["sets"])
                ]
                # the reference bytes: allgather-fused on input set 0 (every variant must match them)
                ag, _ = objs["allgather-fused"]
                ref_out = torch.empty((T, ag.out_heads, ag.head_dim), dtype=out_dtype, device=dev)
                ag.gather(sets[0][0], sets[0][1], sets[0][2], cs, out=ref_out)
                ref = ref_out.view(torch.uint8)
                for name, (qg, flags) in objs.items():
                    out = torch.empty((T, qg.out_heads, qg.head_dim), dtype=out_dtype, device=dev)
                    if flags.get("ag_only"):
                        staging = qg._staging[:T]
                        gathered = qg._gathered[: W * T * H * qg.head_dim]

                        def step(i, qg=qg, staging=staging, gathered=gathered):
                            all_gather_into(gathered, staging, qg._info, qg.timeout_s)

                    elif flags.get("zerocopy"):
                        zn, zp = qg.exposed_shard(T)
                        zn.copy_(sets[0][0])
                        zp.copy_(sets[0][1])
                        qg.gather_exposed(sets[0][2], cs)

                        def step(i, qg=qg, out=out, T=T):
                            qg.exposed_shard(T)  # the ack wait; the projection would write the views here
                            qg.gather_exposed(sets[i % len(sets)][2], cs, out=out)

                    else:

                        def step(i, qg=qg, out=out):
                            n, p, pos = sets[i % len(sets)]
                            qg.gather(n, p, pos, cs, out=out)

                    ok = None
                    if not flags.get("ag_only"):
                        step(0)
                        torch.cuda.synchronize()
                        ok = bool(torch.equal(out.view(torch.uint8), ref))
                    for mode in cfg["modes"]:
                        if mode == "eager" and name not in (EAGER_QUICK if cfg["quick"] else EAGER_VARIANTS):
                            continue
                        us = time_op(
                            step, graph=mode == "graph", calls=cfg["calls"], iters=cfg["iters"], lead_us=cfg["lead_us"]
                        )
                        st = slowest_rank(us)
                        rows.append(
                            dict(
                                H=H,
                                out=out_name,
                                T=T,
                                variant=name,
                                mode=mode,
                                us=st.median,
                                p20=st.p20,
                                p80=st.p80,
                                n=st.n,
                                ok=ok,
                            )
                        )
                    qg.check()
                if peer_mod is not None:
                    ctx = dict(mod=peer_mod, cs=cs, H=H, out_dtype=out_dtype, out_name=out_name)
                    rows.extend(_peer_fused_q(cfg, ctx, T, sets, ref_out))
                if me == 0 and cfg["verbose"]:
                    print(f"[H={H} {out_name}] T={T} done ({len(rows)} rows)", flush=True)
            for qg, _ in objs.values():
                qg.close()
    return rows


def _best_direct(rows: list[dict], H: int, out: str, T: int, mode: str) -> dict | None:
    cands = [
        r
        for r in rows
        if r["H"] == H
        and r["out"] == out
        and r["T"] == T
        and r["mode"] == mode
        and r["variant"].startswith("direct")
        and r["ok"] is True  # a variant whose bytes differ from allgather(fused) cannot be the best
    ]
    return min(cands, key=lambda r: r["us"]) if cands else None


def _lookup(rows, H, out, T, mode, variant):
    for r in rows:
        if (r["H"], r["out"], r["T"], r["mode"], r["variant"]) == (H, out, T, mode, variant):
            return r
    return None


def summary(rows: list[dict], H: int, out: str, mode: str) -> list[dict]:
    table = []
    for T in sorted({r["T"] for r in rows if r["H"] == H and r["out"] == out and r["mode"] == mode}):
        ag = _lookup(rows, H, out, T, mode, "allgather-fused")
        best = _best_direct(rows, H, out, T, mode)
        agonly = _lookup(rows, H, out, T, mode, "nccl-ag-only")
        dflt = _lookup(rows, H, out, T, mode, "direct-cuda-auto-vmm")
        if ag is None or best is None:
            continue
        peer_rows = [
            r
            for r in (_lookup(rows, H, out, T, mode, v) for v in PEER_VARIANTS)
            if r is not None and r["ok"] is not False
        ]
        best_peer = min(peer_rows, key=lambda r: r["us"]) if peer_rows else None
        speed = ag["us"] / best["us"]
        ok = speed >= TARGET_SPEEDUP and (T != 1 or best["us"] <= TARGET_T1_US)
        table.append(
            {
                "T": T,
                "nccl_ag_only": agonly["us"] if agonly else None,
                "allgather_fused": ag["us"],
                "direct_default": dflt["us"] if dflt else None,
                "direct_best": best["us"],
                "best_variant": best["variant"],
                "speedup": speed,
                "best_peer": best_peer["variant"] if best_peer else None,
                "best_peer_us": best_peer["us"] if best_peer else None,
                "vs_best_peer": best_peer["us"] / best["us"] if best_peer else None,
                "target": "met" if ok else "MISSED" if T <= 256 else "-",
                "bytes_ok": all(r["ok"] is not False for r in rows if r["T"] == T and r["H"] == H and r["out"] == out),
            }
        )
    return table


def _peer_lines(rows: list[dict], peers) -> list[str]:
    """One line per Query peer: vLLM's fused_q + all-gather as checked in this run (the first case of each
    output dtype, and every case that differs), or why it did not run; then the peers that never run here."""
    from bench.peers import fused_q as peer_fq

    lines = []
    checked = [r for r in rows if r["variant"] == PEER_FUSED_Q]
    if not checked:
        _, why = peer_fq.load()
        lines.append(f"peer {peer_fq.NAME}: skipped: {why}")
    seen = set()
    for r in checked:
        first = r["out"] not in seen
        seen.add(r["out"])
        if r["mode"] == "check" or (first and r["mode"] != "eager"):
            state = "DIFFERENT ANSWER, not timed" if r["mode"] == "check" else "matches, timed"
            lines.append(f"peer {PEER_FUSED_Q}: {state} (H={r['H']} {r['out']} T={r['T']}: {r['check']})")
    return lines + [f"peer {n}: skipped: {w}" for n, w in peers.QUERY_PEERS]


def main(argv: list[str] | None = None) -> None:
    p = add_common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter))
    p.add_argument("--heads", type=int, nargs="*", default=None, help="heads per rank (default 16 32 64; quick 32)")
    p.add_argument("--tokens", type=int, nargs="*", default=None, help="T values (default 1..512)")
    p.add_argument("--dtypes", nargs="*", default=None, choices=["fp8", "bf16"], help="outputs (default both)")
    p.add_argument("--modes", nargs="*", default=None, choices=["graph", "eager"], help="default both")
    p.add_argument("--verbose", action="store_true", help="print each object's reason and each case's progress")
    p.add_argument(
        "--variants", nargs="*", default=None, help="time only these variants (allgather-fused always runs: reference)"
    )
    args = p.parse_args(argv)
    quick = args.quick
    cfg = {
        "quick": quick,
        "heads": args.heads or ([32] if quick else [16, 32, 64]),
        "tokens": args.tokens or (TOKENS_QUICK if quick else TOKENS_FULL),
        "dtypes": args.dtypes or (["fp8"] if quick else ["fp8", "bf16"]),
        "modes": args.modes or ["graph", "eager"],
        "iters": args.iters or (30 if quick else 100),
        "calls": args.calls or 20,
        "lead_us": args.lead_us,
        "sets": 4,
        "verbose": args.verbose,
        "variants": args.variants,
    }
    # build the CUDA kernel once here, so the ranks only load it
    from peerdcp.query import ops

    t0 = time.time()
    try:
        ops.load()
        print(f"CUDA kernel ready ({time.time() - t0:.1f}s)", flush=True)
    except Exception as e:  # noqa: BLE001 - the ranks fall back to Triton and say so
        print(f"CUDA kernel unavailable: {e}", flush=True)
    t0 = time.time()
    results = run_ranks("bench.query:rank_main", args.world, cfg)
    rows = results[0]  # timings are the slowest rank's on every rank; the byte check must hold on all
    for i, r in enumerate(rows):
        r["ok"] = None if r["ok"] is None else all(res[i]["ok"] for res in results)
    hdr = header()
    from bench import peers

    hdr["peers"] = _peer_lines(rows, peers)
    hdr["wall_s"] = round(time.time() - t0, 1)
    hdr["config"] = cfg
    from pathlib import Path

    from bench.common import write_json

    outdir = Path(args.out)
    path = write_json(outdir / "query.json", {"header": hdr, "rows": rows})
    for H in cfg["heads"]:
        for out in cfg["dtypes"]:
            series = {}
            for v in sorted({r["variant"] for r in rows if r["mode"] == "graph"}):
                pts = sorted(
                    (r["T"], r["us"])
                    for r in rows
                    if (r["H"], r["out"], r["variant"], r["mode"]) == (H, out, v, "graph")
                )
                if pts:
                    series[v] = ([x for x, _ in pts], [y for _, y in pts])
            plot_series(
                outdir / f"query_H{H}_{out}.png",
                series,
                title=f"Query gather, W=2, {H} heads/rank, {out}, CUDA graph",
                xlabel="T (tokens)",
            )
    cols = ["H", "out", "T", "variant", "mode", "us", "p20", "p80", "ok"]
    print(format_table(sorted(rows, key=lambda r: (r["H"], r["out"], r["mode"], r["T"], r["us"])), cols))
    for H in cfg["heads"]:
        for out in cfg["dtypes"]:
            if (H, out) == (32, "fp8"):
                continue
            print(f"\nH={H} {out} graph (µs, slowest rank, median):")
            print(
                format_table(
                    summary(rows, H, out, "graph"),
                    ["T", "allgather_fused", "direct_best", "speedup", "best_variant", "best_peer", "vs_best_peer"],
                )
            )
    print(
        f"\nJSON: {path}; PNG: {outdir}/query_H*_*.png; {hdr.get('gpu')} x{hdr.get('gpus')}, torch {hdr['torch']}, "
        f"triton {hdr['triton']}, wall {hdr['wall_s']} s"
    )
    key = (32, "fp8") if 32 in cfg["heads"] and "fp8" in cfg["dtypes"] else (cfg["heads"][0], cfg["dtypes"][0])
    print(
        f"\nTARGET: W=2, {key[0]} heads/rank, {key[1]}, CUDA graph: direct >= {TARGET_SPEEDUP}x allgather-fused "
        f"for T <= 256 and <= {TARGET_T1_US} us at T=1"
    )
    cols = [
        "T",
        "nccl_ag_only",
        "allgather_fused",
        "direct_default",
        "direct_best",
        "best_variant",
        "speedup",
        "best_peer",
        "best_peer_us",
        "vs_best_peer",
        "target",
        "bytes_ok",
    ]
    print(format_table(summary(rows, key[0], key[1], "graph"), cols))
    print("\n".join(hdr["peers"]))


if __name__ == "__main__":
    main()
