"""Where the indexer scoring kernel's time goes (GPU machine, W = 2): variants of ``_logits_kernel`` side by side.

    python3 scripts/diag/score_sweep.py OUT_DIR [--rows 1 8 32] [--contexts 32768 131072]
        [--configs G:N:S ...] [--policies M/m:N1,N2,..] [--rounds R] [--heads H] [--pdl]
        [--world W] [--emulate] [--variant NAME:KEY=JSON;...]

Variants (DeepSeek-V3.2 indexer, 64 heads x 128; ``same``: every score within 2^-9 of the row's largest
magnitude of the library default's, -inf at the same places): ``lib`` - ``indexer_logits`` as configured;
``gGnN[sS]`` - its kernel with G pages per dot, N pages per program (``P``: the library's policy for that G)
and S pipeline stages (Triton's default without ``s``),
through ``peerdcp.topk.cache.TUNING``; ``empty`` - a one-program kernel that stores one value: the per-call
floor of any kernel in this harness.

The library's choices it measures: the table load masked by the table width, not by the row length; ``keys x q^T``
with 1, 2 or 4 pages per dot (1.3-1.7x faster than ``q x keys^T``); the pages per dot and per program.

``--configs`` replaces the built-in list (``G:N:S``; N or S 0 = the library's choice); ``--policies M/m:N1,N2,..``
adds the library's policy (``peerdcp.topk.cache._scan_npage``) with other candidates (pages per program) and
programs-per-SM floors; ``--rounds R`` times every variant R times, round-robin over the variants (so a drift of
the machine spreads over all of them), and reports the mean with ``spread`` = (max - min) / mean over the rounds
of both layouts.

``--pdl`` adds the library's kernel launched with programmatic dependent launch (``TUNING["scan_pdl"]``): ``pdl1``
waits for the previous kernel inside the kernel, ``pdl2`` also lets the next call launch once every program of this
one started. ``--variant NAME:KEY=JSON;..`` adds the library with ``TUNING`` entries changed (e.g.
``old:scan_wave_npages=[]``). ``--emulate`` runs one process on one GPU as rank 0 of a ``--world`` W group (the
caches' group is faked: the owner-sharded cache holds rank 0's tokens, the ranks' largest share): the scans are
local, so their times are rank 0's of a real W-rank run, without the slowest-rank reduction.

``--floor`` adds two reads of the same pages' bytes without the scan's math: ``sum``
(``torch.sum`` of their fp32 view) and ``stream`` (a Triton kernel, 8 KB per step, 8 steps per program, 3
stages); ``rep_TBs`` / ``sh_TBs`` are every variant's scanned bytes per second (TB/s). After the table: every
compiled scoring kernel's registers, shared memory and resident programs per SM.

Measured and not in the library (bench/RESULTS.md, History): two loops that run ahead of the dot (slower); a
persistent kernel (a balanced (row, page) split over F programs per SM; 20-30 % slower); a table-first
loop at 3 and 4 stages with the keys triple-buffered (up to 7 % faster replicated at 128 rows, slower sharded and
at 8-64 rows).

Prints one table: µs per call (CUDA graph, 20 calls per replay, slowest rank, median), replicated (``rep``) and
owner-sharded (``sh``) caches, and the ratio sh / rep. A diagnosis tool, not a claim (bench/topk makes the claims).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import format_table, run_ranks, slowest_rank, time_op, warm_gpu  # noqa: E402
from bench.floor import empty_kernel  # noqa: E402

# (pages per dot, pages per program, pipeline stages; 0 = the library's choice)
CONFIGS = [(1, 0, 0), (1, 0, 2), (1, 4, 0), (1, 4, 2), (1, 16, 0), (1, 16, 2)]


def _same(ref: torch.Tensor, got: torch.Tensor) -> bool:
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(got)) or not torch.equal(torch.isneginf(ref), torch.isneginf(got)):
        return False
    if not fin.any():
        return True
    scale = ref[fin].abs().max()
    return bool(((ref[fin] - got[fin]).abs() <= scale * 2.0**-9).all())


def _local_max(c, tabs, ctx: int, lay: str, W: int) -> int:
    """The scored width of a case: the table's pages, cut to the (local) context."""
    return min(tabs[0].shape[1] * c.page_size, ctx if lay == "replicated" else -(-ctx // W))


@triton.jit
def _stream_kernel(x, n, out, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program p xors the int32 words ``p * BLOCK * ITERS ..`` (BLOCK per step, 8 KB: one page's keys) into one."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(x + o, mask=o < n, other=0)
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, 0))


def _stream(x: torch.Tensor) -> torch.Tensor:
    """A plain streaming read of ``x`` (int32) with Triton's pipeline: the scan's bytes without its math."""
    block, iters = 2048, 8
    grid = (triton.cdiv(x.numel(), block * iters),)
    out = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    _stream_kernel[grid](x, x.numel(), out, BLOCK=block, ITERS=iters, num_warps=4, num_stages=3)
    return out


def _kernel_report(dev: torch.device) -> list[str]:
    """Every compiled scoring kernel on ``dev``: registers, spills, shared memory, pipeline stages and resident
    programs per SM (``cuOccupancyMaxActiveBlocksPerMultiprocessor``)."""
    from cuda.bindings import driver

    from peerdcp.topk.kernels import _logits_kernel

    lines = []
    for key, ck in _logits_kernel.device_caches[dev.index][0].items():  # (Triton 3.6: key -> CompiledKernel)
        md = ck.metadata
        err, occ = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            driver.CUfunction(ck.function), md.num_warps * 32, md.shared
        )
        lines.append(
            f"regs {ck.n_regs} spills {ck.n_spills} smem {md.shared} stages {md.num_stages} "
            f"per_sm {occ if err == 0 else err} | {str(key)[-160:]}"
        )
    return lines


def _emulate_group(W: int) -> None:
    """Make ``IndexKCache`` in this (one-rank) process believe it is rank 0 of a W-rank group."""
    import dataclasses

    from peerdcp.topk import cache as cache_mod

    real = cache_mod.resolve_group
    cache_mod.resolve_group = lambda g: dataclasses.replace(real(g), rank=0, world_size=W, global_ranks=tuple(range(W)))
    cache_mod.all_gather_object = lambda info, obj: [obj] * W


def rank_main(cfg: dict) -> list[dict]:
    import torch.distributed as dist

    from bench.topk import indexer_case
    from peerdcp.topk import cache as cache_mod
    from peerdcp.topk import indexer_logits

    W = cfg["world"] if cfg["emulate"] else dist.get_world_size()
    if cfg["emulate"]:
        _emulate_group(W)
    dev = torch.device("cuda", torch.cuda.current_device())
    warm_gpu(0.3)
    H = cfg["heads"]
    rows_out = []
    flag = torch.zeros(1, device=dev)
    us = slowest_rank(time_op(lambda i: empty_kernel[(1,)](flag), calls=20, iters=cfg["iters"])).median
    rows_out.append(
        {"ctx": 0, "rows": 0, "variant": "empty", "rep": us, "sh": us, "ratio": 1.0, "same": True, "spread": 0.0}
    )
    for ctx in cfg["contexts"]:
        for T in cfg["rows"]:
            gen = torch.Generator(device=dev).manual_seed(ctx + T)
            caches, q, w, lens, nsets = indexer_case(ctx, T, H, W, gen, dev)

            def cfg_fn(group, npage, stages, **policy):
                def fn(q, w, c, tab, L):
                    tune = {"scan_group": group, "scan_npage": npage, "scan_stages": stages, **policy}
                    with mock.patch.dict(cache_mod.TUNING, tune):
                        return indexer_logits(q, w, c, lens, block_table=tab, max_seq_len=ctx)

                return fn

            variants = {"lib": lambda q, w, c, tab, L: indexer_logits(q, w, c, lens, block_table=tab, max_seq_len=ctx)}
            for name, tune in cfg["variants"]:  # --variant NAME:KEY=JSON,...
                variants[name] = cfg_fn(cache_mod.TUNING["scan_group"], 0, cache_mod.TUNING["scan_stages"], **tune)
            for mode in (1, 2) if cfg["pdl"] else ():
                variants[f"pdl{mode}"] = cfg_fn(
                    cache_mod.TUNING["scan_group"], 0, cache_mod.TUNING["scan_stages"], scan_pdl=mode
                )
            for g, n, st in cfg["configs"]:
                variants[f"g{g}n{n or 'P'}" + (f"s{st}" if st else "")] = cfg_fn(g, n, st)
            for m, m_small, npages in cfg["policies"]:  # the library's group and stages, the policy's npage
                tune = {"scan_min_programs_per_sm": m, "scan_min_programs_per_sm_small": m_small, "scan_npages": npages}
                variants[f"p{m:g}/{m_small:g}:{','.join(map(str, npages))}"] = cfg_fn(
                    cache_mod.TUNING["scan_group"], 0, cache_mod.TUNING["scan_stages"], **tune
                )
            if cfg["floor"]:  # plain reads of the same pages' bytes: torch's sum and a Triton stream
                spans = {}  # id(block table) -> the int32 view of its pages
                for c, tabs, _ in caches.values():
                    for tab in tabs:
                        lo, hi = int(tab.min()), int(tab.max()) + 1
                        spans[id(tab)] = c._alive().view(-1)[lo * c.page_bytes : hi * c.page_bytes].view(torch.int32)
                variants["sum"] = lambda q, w, c, tab, L: spans[id(tab)].view(torch.float32).sum()
                variants["stream"] = lambda q, w, c, tab, L: _stream(spans[id(tab)])
            nbytes = {lay: T * tabs[0].shape[1] * c.page_bytes for lay, (c, tabs, _) in caches.items()}
            rows = {
                name: {"ctx": ctx, "rows": T, "variant": name, "same": True, "rep": [], "sh": []} for name in variants
            }
            refs = {}  # (layout, set) -> the library's scores, once per case
            for lay in ("replicated", "owner_sharded"):
                c, tabs, _ = caches[lay]
                Lq = _local_max(c, tabs, ctx, lay, W)
                for j in range(nsets):
                    refs[lay, j] = variants["lib"](q[j], w[j], c, tabs[j], Lq)[:, :Lq]
            for name, fn in variants.items():
                if name in ("sum", "stream"):
                    rows[name]["same"] = None  # (no scores)
                    continue
                for lay in ("replicated", "owner_sharded"):
                    c, tabs, _ = caches[lay]
                    Lq = _local_max(c, tabs, ctx, lay, W)
                    for j in range(nsets):
                        got = fn(q[j], w[j], c, tabs[j], Lq)
                        rows[name]["same"] &= _same(refs[lay, j], got[:, :Lq])
            del refs
            for _ in range(cfg["rounds"]):
                for name, fn in variants.items():
                    for lay, key in (("replicated", "rep"), ("owner_sharded", "sh")):
                        c, tabs, _ = caches[lay]
                        Lq = _local_max(c, tabs, ctx, lay, W)

                        def step(i, fn=fn, c=c, tabs=tabs, Lq=Lq):
                            return fn(q[i % nsets], w[i % nsets], c, tabs[i % nsets], Lq)

                        rows[name][key].append(slowest_rank(time_op(step, calls=20, iters=cfg["iters"])).median)
            for row in rows.values():
                spread = max((max(v) - min(v)) / statistics.mean(v) for v in (row["rep"], row["sh"]))
                row["rep_rounds"], row["sh_rounds"] = row["rep"], row["sh"]
                row["rep"], row["sh"] = statistics.mean(row["rep"]), statistics.mean(row["sh"])
                row["ratio"], row["spread"] = row["sh"] / row["rep"], spread
                row["rep_TBs"] = nbytes["replicated"] / row["rep"] / 1e6  # bytes / us -> TB/s
                row["sh_TBs"] = nbytes["owner_sharded"] / row["sh"] / 1e6
                rows_out.append(row)
                if dist.get_rank() == 0:  # progress: a stage cut short by its time limit keeps what it measured
                    print(f"{ctx} x {T} {row['variant']}: rep {row['rep']:.2f} sh {row['sh']:.2f} "
                          f"ratio {row['ratio']:.3f} spread {spread:.3f} same {row['same']}", flush=True)  # fmt: skip
            for c, _, _ in caches.values():
                c.close()
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print("\n".join(_kernel_report(dev)), flush=True)
    return rows_out if dist.get_rank() == 0 else []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--floor", action="store_true", help="add `sum` and `stream`: plain reads of the scanned pages")
    ap.add_argument("--pdl", action="store_true", help="add pdl1 / pdl2: the library's kernel launched with PDL")
    ap.add_argument(
        "--variant", action="append", default=[], help="NAME:KEY=JSON[;KEY=JSON]: the library with TUNING changed"
    )
    ap.add_argument("--world", type=int, default=2, help="W (ranks, or the emulated group's size)")
    ap.add_argument("--emulate", action="store_true", help="one process on one GPU as rank 0 of a --world group")
    ap.add_argument("--configs", nargs="*", default=None, help="G:N:S triples (default: the built-in CONFIGS)")
    ap.add_argument("--policies", nargs="+", default=[], help="M/m:N1,N2,... (programs per SM: candidates)")
    a = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in a.configs] if a.configs is not None else CONFIGS
    policies = []
    for spec in a.policies:  # "M/m:N1,N2,..."
        ms, ns = spec.split(":")
        m, m_small = (float(x) for x in ms.split("/"))
        policies.append((m, m_small, tuple(int(x) for x in ns.split(","))))
    variants = []
    for spec in a.variant:  # "old:scan_wave_npages=[];scan_pdl=1"
        name, _, body = spec.partition(":")
        variants.append((name, {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in body.split(";") if kv)}))
    cfg = {"rows": a.rows, "contexts": a.contexts, "iters": a.iters, "rounds": a.rounds, "heads": a.heads,
           "configs": configs, "policies": policies, "floor": a.floor, "pdl": a.pdl, "world": a.world,
           "variants": variants, "emulate": a.emulate}  # fmt: skip
    res = run_ranks("scripts.diag.score_sweep:rank_main", 1 if a.emulate else a.world, cfg)
    rows = res[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "score_sweep.json").write_text(json.dumps(rows, indent=1))
    print(format_table(rows, ["ctx", "rows", "variant", "same", "rep", "sh", "ratio", "spread", "rep_TBs", "sh_TBs"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
