"""``peerdcp generate``: a Hugging Face transformers DSA/MLA model decoding greedily with DCP on W ranks, beside
the same model unsharded, with the parity verdict (:mod:`peerdcp.integrations.transformers.verdict`).

One process per GPU when there are at least W GPUs (or ranks sharing GPUs with ``PEERDCP_SHARED_GPU=1``: checked,
not timed), else 2 CPU processes over host memory with the Triton kernels interpreted. The model comes from a tiny
random config of ``--family`` (no weights are downloaded; none are needed), or ``--config`` (a local config.json;
``--weights`` for local safetensors). Exit status 0 only when the verdict passes; 1 when it fails, naming the
mechanism; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from .console import positive_int, progress, short

__all__ = ["add_generate_arguments", "main_generate"]


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    from ..integrations.transformers.configs import FAMILY_NAMES

    p.add_argument("--family", default="deepseek-v3.2", choices=sorted(FAMILY_NAMES), help="model family")
    p.add_argument(
        "--size",
        default=None,
        choices=["tiny", "attention"],
        help="tiny (CPU-sized: 6 heads) or attention (the real attention geometry: 128 heads, 2 layers, small "
        "MoE); default: attention on GPUs, tiny on CPU",
    )
    p.add_argument("--config", default=None, help="a local config.json (or its folder) instead of the tiny config")
    p.add_argument(
        "--weights", default=None, help="a local folder of safetensors (as save_pretrained writes them) for --config"
    )
    p.add_argument("--world", type=positive_int, default=None, help="ranks (default: GPUs if >= 2, else 2 CPU)")
    p.add_argument("--new-tokens", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=12, help="the longest prompt's tokens")
    p.add_argument("--batch", type=positive_int, default=2, help="prompts, of different lengths")
    p.add_argument("--interleave", type=positive_int, default=1, help="ownership interleave I")
    p.add_argument("--indexer", default="fp8", choices=["fp8", "exact"])
    p.add_argument("--query", default="bf16", choices=["bf16", "fp8"], help="the gathered query's dtype")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the model's dtype")
    p.add_argument("--chunk", type=positive_int, default=256, help="rows per exchange call (prompts run in chunks)")
    for mech in ("query", "topk", "output"):
        p.add_argument(f"--{mech}-backend", default="auto", choices=["auto", "direct", "collective"])
    p.add_argument("--memory", default="auto", choices=["auto", "vmm", "symm", "host"])
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--no-timing", action="store_true", help="skip the collective-backend decode (and its timing)")
    p.add_argument("--json", default=None, help="write the report as JSON to this path")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config field (int, float or string), e.g. num_hidden_layers=2",
    )
    p.add_argument("--fault", default="none", help=argparse.SUPPRESS)  # tests only: prove the verdict can fail


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"--override takes KEY=VALUE, got {item!r}")
        for cast in (int, float):
            try:
                out[k] = cast(v)
                break
            except ValueError:
                continue
        else:
            out[k] = v
    return out


def main_generate(args: argparse.Namespace) -> int:
    from ..integrations.transformers import check_transformers, checks, decode
    from ..integrations.transformers.verdict import verdict
    from .launch import RankPool, placement

    try:
        check_transformers()
        overrides = _overrides(args.override)
    except (ImportError, ValueError) as e:
        print(f"peerdcp generate: {e}", file=sys.stderr)
        return 2
    if args.fault not in checks.FAULTS:
        print(f"unknown --fault {args.fault!r}; choose one of {checks.FAULTS}", file=sys.stderr)
        return 2
    place = placement(args.world)
    world, gpu, shared = place.world, place.on_gpu, place.shared
    timed_label = (
        "measured"
        if place.timed
        else "not a performance figure (" + ("ranks share a GPU)" if shared else "Triton interpreter on CPU)")
    )
    wargs = dict(
        family=args.family,
        size=args.size or ("attention" if gpu else "tiny"),
        config=args.config,
        weights=args.weights,
        seed=args.seed,
        dtype=args.dtype,
        batch=args.batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        chunk=args.chunk,
        interleave=args.interleave,
        indexer=args.indexer,
        query=args.query,
        memory=args.memory,
        timeout_s=60.0,
        fault=args.fault,
        timing=not args.no_timing,
        overrides=overrides,
        backends={"query": args.query_backend, "topk": args.topk_backend, "output": args.output_backend},
    )
    report: dict = {
        "world": world,
        "where": place.where,
        "args": {k: v for k, v in wargs.items() if k != "backends"},
        "backends_requested": wargs["backends"],
        "timing": timed_label,
    }
    prog = progress()
    pool = None
    t0 = time.time()
    steps = 1 + decode.PHASES  # the pool's start, then each phase
    try:
        if prog:
            prog.start()
            task = prog.add_task("start rank processes", total=steps)
        pool = RankPool(world, backend=place.backend)
        if prog:
            prog.advance(task)

        started = itertools.count(1)  # the pool's start is step 0

        def on_phase(desc: str) -> None:
            if prog:
                prog.update(task, description=desc, completed=next(started))

        report.update(decode.run_phases(pool, wargs, on_phase))
        if prog:
            prog.update(task, completed=steps)
    except Exception as e:  # a rank failed: report what happened, never hang
        if prog:
            prog.stop()
            prog = None
        print(f"peerdcp generate: FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if prog:
            prog.stop()
        if pool is not None:
            pool.close()
    report["seconds"] = round(time.time() - t0, 1)
    report["verdict"] = verdict(
        report["reference_free"][0],
        [r for r in report["dcp_forced"]],
        report["reference_forced"][0],
        report["dcp_free"],
    )
    _print_report(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if report["verdict"]["ok"] else 1


def _print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    s, a = rep["setup"][0], rep["args"]
    g = s["geometry"]
    con.print(
        f"[bold]peerdcp generate[/bold]: {s['family']} ({s['size']}: {g['layers']} layers, hidden {g['hidden']}, "
        f"{g['heads']} heads, MLA {g['kv_lora']} + {g['rope']}"
        + (f", indexer {g['index']}" if g["index"] else "")
        + f") on {rep['where']}; batch {a['batch']} (prompts "
        f"{s['prompt_lens']} tokens), {a['new_tokens']} new tokens, {s['heads_per_rank']} heads per rank, "
        f"interleave {a['interleave']}" + (f", top-{s['topk']}, {a['indexer']} indexer" if s["topk"] else ", dense")
    )
    t = Table(title="what ran where, and why (full reasons: --json)")
    for c in ("mechanism", "backend", "memory", "reason"):
        t.add_column(c)
    for name, m in s["mechanisms"].items():
        t.add_row(name, str(m["backend"]), str(m["memory"]), short(m["reason"]))
    con.print(t)
    v = rep["verdict"]
    t = Table(title="parity with the unsharded model")
    for c in ("check", "result", "detail"):
        t.add_column(c)
    for name, m in v["mechanisms"].items():
        res = "[green]ok[/green]" if not m["bad_calls"] else "[red]FAIL[/red]"
        t.add_row(
            f"{name}, every call",
            res,
            f"{m['calls']} calls (all ranks)" + (f"; first: {m['first']}" if m["first"] else ""),
        )
    tf = v["teacher_forced"]
    t.add_row(
        "teacher-forced logits",
        "[green]within[/green]" if tf["worst_ratio"] <= 1 else "[red]FAIL[/red]",
        f"worst {tf['worst_ratio']:.2f} of the bound ({tf['ulps']} bf16 ulps of the step's largest logit)"
        + (f", row {tf['row']} step {tf['step']}: {tf['max_diff']:.2e} vs {tf['bound']:.2e}" if "row" in tf else "")
        + f"; pinned where the reference chose otherwise: {tf['router_rows_pinned']} router rows, "
        f"{tf['topk_calls_pinned']} top-k calls; DCP's run: {rep['dcp_forced'][0]['from']}",
    )
    fr = v["free_running"]
    detail = f"equal steps per row {fr['equal_steps']} of {a['new_tokens']}"
    for d in fr["diverged"]:
        detail += (
            f"; row {d['row']} parts at step {d['step']} (reference margin {d['margin']:.3g}, twice the "
            f"bound {d['twice_bound']:.3g})"
        )
    free_ok = not any(f.startswith("free-running") for f in v["failures"])
    t.add_row("free-running greedy tokens", "[green]ok[/green]" if free_ok else "[red]FAIL[/red]", detail)
    con.print(t)
    if a["timing"]:
        _print_times(con, rep)
    _print_capacity(con, rep)
    if v["ok"]:
        con.print(f"verdict: [bold green]PASS[/bold green] ({rep['seconds']} s)")
    else:
        for f in v["failures"]:  # (plain lines, never wrapped: scripts grep them)
            print(f"FAIL {f}", flush=True)
        con.print(f"verdict: [bold red]FAIL[/bold red] ({rep['seconds']} s)")


def _print_times(con, rep: dict) -> None:
    from rich.table import Table

    s, f0 = rep["setup"][0], rep["dcp_free"][0]
    t = Table(title=f"decode time per token, slowest rank (median; {rep['timing']})")
    for c in ("backends", "ms per token"):
        t.add_column(c)
    slowest = max((r["ms_per_token"] or 0.0) for r in rep["dcp_free"])
    t.add_row(
        "chosen (" + ", ".join(f"{k} {m['backend']}" for k, m in s["mechanisms"].items() if k != "indexer") + ")",
        f"{slowest:.2f}",
    )
    if "collective_ms_per_token" in f0:
        col = max((r["collective_ms_per_token"] or 0.0) for r in rep["dcp_free"])
        t.add_row(
            "collective ("
            + ", ".join(f"{k} {m['backend']}" for k, m in s["collective"].items() if k != "indexer")
            + ")",
            f"{col:.2f}",
        )
    con.print(t)


def _print_capacity(con, rep: dict) -> None:
    from rich.table import Table

    t = Table(title="capacity per rank vs replicated")
    for c in ("rank", "KV bytes local / replicated", "index-K bytes local / replicated"):
        t.add_column(c)
    for c in rep["capacity"]:
        ik = f"{c['index_k_bytes_local']:,} / {c['index_k_bytes_replicated']:,}" if "index_k_bytes_local" in c else "-"
        t.add_row(str(c["rank"]), f"{c['kv_bytes_local']:,} / {c['kv_bytes_replicated']:,}", ik)
    con.print(t)
