"""``peerdcp run``: the main job — one DCP decode step of a DSA/MLA layer through all three mechanisms,
checked against the unsharded computation, with timings, capacity, a report, JSON and a PNG.

On a machine with >= 2 GPUs it runs one process per GPU at the real geometry; otherwise 2 CPU processes
over host shared memory (Triton interpreter) at a scaled-down geometry that finishes in about a minute.
Exit status 0 only when every parity check passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from .console import positive_int, progress, short
from .geometry import GEOMETRIES, get_geometry

__all__ = ["add_run_arguments", "main_run"]


def _row_list(text: str) -> list[int]:
    return [positive_int(x) for x in text.split(",")]


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    # (bad values are usage errors, exit 2, before any rank starts; exit 1 is a failed parity check)
    p.add_argument("--geometry", default="deepseek-v3.2", choices=sorted(GEOMETRIES), help="layer geometry")
    p.add_argument(
        "--rows", type=_row_list, default=None,
        help="decode rows T, or a comma list run one after another (default: 8 GPU, 2 CPU)",
    )  # fmt: skip
    p.add_argument("--context", type=positive_int, default=None, help="context length (default: 32768 GPU, 256 CPU)")
    p.add_argument(
        "--world", type=positive_int, default=None, help="ranks (default: all GPUs if >= 2, else 2 CPU processes)"
    )
    p.add_argument("--query-backend", default="auto", choices=["auto", "direct", "allgather"])
    p.add_argument("--topk-backend", default="auto", choices=["auto", "direct", "allgather"])
    p.add_argument("--output-backend", default="auto", choices=["auto", "direct", "a2a", "ag_rs"])
    p.add_argument("--memory", default="auto", choices=["auto", "vmm", "symm", "host"])
    p.add_argument("--scaled", action="store_true", help="use the scaled-down geometry even on GPUs")
    p.add_argument("--reps", type=positive_int, default=None, help="timed calls per mechanism (50 GPU, 2 CPU)")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--json", default=None, help="write the report as JSON to this path")
    p.add_argument("--png", default=None, help="write a bar chart of the timings to this path")
    p.add_argument("--fault", default="none", help=argparse.SUPPRESS)  # tests only: prove the check can fail


def main_run(args: argparse.Namespace) -> int:
    from . import step
    from .launch import RankPool, placement

    if args.fault not in step.FAULTS:
        print(f"unknown --fault {args.fault!r}; choose one of {step.FAULTS}", file=sys.stderr)
        return 2
    # PEERDCP_SHARED_GPU=1: ranks may share GPUs (rank r on GPU r % ngpu), for a correctness run with more
    # ranks than GPUs; the baselines then go through gloo, and nothing is timed
    place = placement(args.world)
    world, gpu, shared = place.world, place.on_gpu, place.shared
    g = get_geometry(args.geometry)
    if not gpu or args.scaled:
        g = g.scaled_for_cpu()
    if g.heads % world:  # (checked in the ranks too; here before any rank starts)
        print(f"peerdcp run: {g.name}'s {g.heads} heads do not split over {world} ranks", file=sys.stderr)
        return 2
    row_list = args.rows if args.rows else [8 if gpu else 2]
    context = args.context or (32768 if gpu else 256)
    reps = args.reps or (50 if gpu else 2)
    backends = {"query": args.query_backend, "topk": args.topk_backend, "output": args.output_backend}
    steps = [
        ("create peer objects (collective)", "objects",
         lambda pool, rows: pool.run(step.setup, dataclasses.asdict(g), rows, context, backends, args.memory,
                                     args.seed, args.fault)),
        ("generate weights, activations, KV history", "data", lambda pool, rows: pool.run(step.generate)),
        ("decode step: query -> indexer/top-k -> attention -> output", "forward",
         lambda pool, rows: pool.run(step.forward)),
        ("unsharded reference and parity check", "check", lambda pool, rows: pool.run(step.check)),
        ("time each mechanism against its collective baseline", "timings",
         lambda pool, rows: pool.run(step.timings, reps)),
        ("capacity", "capacity", lambda pool, rows: pool.run(step.capacity)),
        ("close", None, lambda pool, rows: pool.run(step.teardown)),
    ]  # fmt: skip
    if shared:  # time-sliced ranks: a timing would measure the GPU's scheduler
        steps = [s for s in steps if s[1] != "timings"]
    reports = []
    prog = progress()
    pool = None
    try:
        if prog:
            prog.start()
            task = prog.add_task("start rank processes", total=1 + len(steps) * len(row_list))
        pool = RankPool(world, backend=place.backend)
        if prog:
            prog.advance(task)
        for rows in row_list:
            t0 = time.time()
            report: dict = {"geometry": dataclasses.asdict(g), "world": world, "rows": rows, "context": context,
                            "where": place.where, "fault": args.fault, "interpreted": not gpu}  # fmt: skip
            for desc, key, fn in steps:
                if prog:
                    prog.update(task, description=f"T={rows}: {desc}")
                res = fn(pool, rows)
                if key:
                    report[key] = res
                if prog:
                    prog.advance(task)
            report["seconds"] = round(time.time() - t0, 1)
            report["ok"] = all(r["ok"] for r in report["check"])
            reports.append(report)
    finally:
        if prog:
            prog.stop()
        if pool is not None:
            pool.close()
    for report in reports:
        _print_report(report)
    ok = all(r["ok"] for r in reports)
    if len(reports) > 1:
        print("overall verdict:", "PASS" if ok else "FAIL")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(reports[0] if len(reports) == 1 else reports, f, indent=2, default=str)
    if args.png and "timings" in reports[0]:
        _plot(reports, args.png)
    return 0 if ok else 1


def _print_report(rep: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(json.dumps(rep, indent=2, default=str))
        return
    con = Console()
    g = rep["geometry"]
    con.print(
        f"[bold]peerdcp run[/bold]: {g['name']} ({g['heads']} heads, MLA {g['nope_dim']}+{g['rope_dim']}"
        + (f", DSA indexer {g['index_heads']}x{g['index_dim']} top-{g['topk']}" if g["index_heads"] else ", dense")
        + f") on {rep['where']}; {rep['rows']} rows, context {rep['context']}"
    )
    o = rep["objects"][0]
    t = Table(title="what ran where, and why (full reasons: --json)")
    for c in ("mechanism", "backend", "memory", "reason"):
        t.add_column(c)
    for name in ("query", "topk", "output"):
        if name in o:
            t.add_row(name, o[name]["backend"], str(o[name]["memory"]), short(o[name]["reason"]))
    con.print(t)
    t = Table(title="parity with the unsharded step (per rank)")
    for c in ("rank", "query (bytes)", "top-k ids equal", "merge (fp32 bound)", "output rel err", "verdict"):
        t.add_column(c)
    for r, c in enumerate(rep["check"]):
        t.add_row(
            str(r),
            "ok" if c["query_ok"] else f"FAIL (max {c['query_max_abs']:.3g})",
            "-" if "topk_equal" not in c else ("ok" if c["topk_equal"] else "FAIL"),
            "ok" if c["merge_outside"] == 0 else f"FAIL ({c['merge_outside']} outside)",
            f"{c['output_rel_err']:.2e}",
            "[green]PASS[/green]" if c["ok"] else "[red]FAIL[/red]",
        )
    con.print(t)
    if "timings" in rep and not rep.get("interpreted"):
        t = Table(title="time per call, slowest rank (median; eager, 10-call bursts)")
        for c in ("mechanism", "peerdcp (us)", "collective baseline (us)", "speed-up"):
            t.add_column(c)
        for name, v in rep["timings"][0].items():
            t.add_row(
                name, f"{v['peerdcp_us']:.1f}", f"{v['baseline_us']:.1f}", f"{v['baseline_us'] / v['peerdcp_us']:.2f}x"
            )
        con.print(t)
    elif "timings" in rep:  # the Triton interpreter on CPU: its times say nothing about GPU speed, so no ratio
        t = Table(title="interpreter time per call on CPU (measures nothing about performance; run on GPU for that)")
        for c in ("mechanism", "peerdcp, interpreted (us)", "collective baseline, CPU (us)"):
            t.add_column(c)
        for name, v in rep["timings"][0].items():
            t.add_row(name, f"{v['peerdcp_us']:.1f}", f"{v['baseline_us']:.1f}")
        con.print(t)
    cap = rep["capacity"]
    t = Table(title="capacity per rank vs replicated")
    for c in ("rank", "KV tokens local / logical", "KV bytes local / replicated", "index-K bytes local / replicated"):
        t.add_column(c)
    for r, c in enumerate(cap):
        ik = f"{c['index_k_bytes_local']:,} / {c['index_k_bytes_replicated']:,}" if "index_k_bytes_local" in c else "-"
        t.add_row(str(r), f"{c['kv_tokens_local']:,} / {c['kv_tokens_logical']:,}",
                  f"{c['kv_bytes_local']:,} / {c['kv_bytes_replicated']:,}", ik)  # fmt: skip
    con.print(t)
    verdict = "[bold green]PASS[/bold green]" if rep["ok"] else "[bold red]FAIL: parity check failed[/bold red]"
    con.print(f"verdict: {verdict} ({rep['seconds']} s)")


def _plot(reports: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(reports[0]["timings"][0])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    rows = [r["rows"] for r in reports]
    for ax, n in zip(axes[0], names):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["timings"][0][n]["peerdcp_us"] for r in reports], 0.4, label="peerdcp")
        ax.bar([i + 0.2 for i in x], [r["timings"][0][n]["baseline_us"] for r in reports], 0.4, label="collective")
        ax.set_xticks(list(x), [f"T={t}" for t in rows])
        ax.set_title(n)
        ax.set_ylabel(
            "us per call (slowest rank, eager)"
            + (", interpreter: not a speed" if reports[0].get("interpreted") else "")
        )
        ax.legend(fontsize=8)
    fig.suptitle(f"peerdcp run: {reports[0]['geometry']['name']}, context {reports[0]['context']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
