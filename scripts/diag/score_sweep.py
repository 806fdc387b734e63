"""Where the indexer scoring kernel's time goes (GPU machine, W = 2): variants of ``_logits_kernel`` side by side.

    python3 scripts/diag/score_sweep.py OUT_DIR [--rows 1 8 32] [--contexts 32768 131072]

Variants (each checked equal to the library kernel's output first; DeepSeek-V3.2 indexer, 64 heads x 128):

* ``lib``    - ``indexer_logits`` as shipped: the page-table load waits for the row length (masked by it), the
  key load for the page -> three dependent global loads (length, table entry, keys) before the dot.
* ``v1``     - the table entry is loaded masked by the table's width instead, in parallel with the length:
  two dependent loads (length | table, then keys).
* ``v1spec`` - ``v1`` with the key load masked only by the table width (reads pages past a short row's end;
  a floor, not a candidate for ragged batches).
* ``v1np1`` / ``v1np4`` - ``v1`` with 1 / 4 pages per program forced; ``v1w8`` - 8 warps.
* ``empty``  - a one-program kernel that stores one value: the per-call floor of any kernel in this harness.

Session 8 (call 1) ran this against the kernel of that time; ``v1`` measured 0.1-3 us faster than ``lib``
and became the library's kernel (peerdcp/topk/kernels.py), so ``lib`` and ``v1`` are the same since.

Prints one table: µs per call (CUDA graph, 20 calls per replay, slowest rank, median), replicated (``rep``) and
owner-sharded (``sh``) caches, and the ratio sh / rep. A diagnosis tool, not a claim (bench/topk makes the claims).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import format_table, run_ranks, slowest_rank, time_op, warm_gpu  # noqa: E402


@triton.jit
def _empty_kernel(out):
    tl.store(out + tl.program_id(0), 1.0)


@triton.jit
def _logits_v1(
    q8, q_stride, w, w_stride, seq_lens, table, table_stride, table_cols, kv8, kv32, out, out_stride, Lmax, H,
    num_pages, rank, W, I,
    NPAGE: tl.constexpr, PAGE: tl.constexpr, PAGE_BYTES: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    SHARDED: tl.constexpr, SPEC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    L = tl.load(seq_lens + t).to(tl.int64)
    if SHARDED:
        rem = L % (I * W) - rank * I
        rem = tl.minimum(tl.maximum(rem, 0), I)
        nloc = (L // (I * W)) * I + rem
    else:
        nloc = L
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    n = tl.arange(0, PAGE)
    q = tl.load(q8 + t * q_stride + h[:, None] * D + d[None, :], mask=h[:, None] < H, other=0.0)
    wv = tl.load(w + t * w_stride + h, mask=h < H, other=0.0)
    first = jb * NPAGE
    npg_row = (nloc + PAGE - 1) // PAGE
    for i in range(NPAGE):
        j = (first + i).to(tl.int64)
        inb = j < table_cols
        page = tl.load(table + t * table_stride + j, mask=inb, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        if SPEC:
            live = inb
        else:
            live = j < npg_row
        base = page * PAGE_BYTES
        kt = tl.load(kv8 + base + n[:, None] * D + d[None, :], mask=live, other=0.0)
        ks = tl.load(kv32 + (base + PAGE * D) // 4 + n, mask=live, other=0.0)
        s = tl.dot(q, tl.trans(kt), out_dtype=tl.float32)
        r = tl.sum(tl.maximum(s, 0.0) * wv[:, None], axis=0) * ks
        l = j * PAGE + n
        r = tl.where(l < nloc, r, float("-inf"))
        tl.store(out + t * out_stride + l, r, mask=l < Lmax)


def _v1(q, w, c, lens, tab, Lmax, *, npage=None, warps=4, spec=False):
    T, H, D = q.shape
    P = c.page_size
    pages = triton.cdiv(Lmax, P)
    if npage is None:
        sms = torch.cuda.get_device_properties(q.device.index).multi_processor_count
        npage = 1
        while npage < 16 and T * pages // (npage * 4) >= 4 * sms:
            npage *= 4
    out = torch.empty(T, Lmax, dtype=torch.float32, device=q.device)
    store = c._alive()
    _logits_v1[(T, triton.cdiv(pages, npage))](
        q, q.stride(0), w, w.stride(0), lens, tab, tab.stride(0), tab.shape[1],
        store.view(-1).view(torch.float8_e4m3fn), store.view(-1).view(torch.float32), out, out.stride(0), Lmax, H,
        c.num_pages, c.rank, c.world_size, c.interleave,
        NPAGE=npage, PAGE=P, PAGE_BYTES=c.page_bytes, D=D, BLOCK_H=max(64, triton.next_power_of_2(H)),
        SHARDED=c.sharded, SPEC=spec, num_warps=warps,
    )  # fmt: skip
    return out


def rank_main(cfg: dict) -> list[dict]:
    import torch.distributed as dist

    import peerdcp
    from bench.topk import _random_keys
    from peerdcp.topk import indexer_logits

    W = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    warm_gpu(0.3)
    H = 64
    rows_out = []
    flag = torch.zeros(1, device=dev)
    us = slowest_rank(time_op(lambda i: _empty_kernel[(1,)](flag), calls=20, iters=cfg["iters"])).median
    rows_out.append({"ctx": 0, "rows": 0, "variant": "empty", "rep": us, "sh": us, "ratio": 1.0, "same": True})
    for ctx in cfg["contexts"]:
        for T in cfg["rows"]:
            gen = torch.Generator(device=dev).manual_seed(ctx + T)
            nsets = 4 if T * ctx * 132 < (256 << 20) else 1
            nseq = nsets * T
            caches = {}
            for lay in ("replicated", "owner_sharded"):
                align = 64 * W if lay == "owner_sharded" else 64
                span = -(-ctx // align) * align
                c = peerdcp.IndexKCache(capacity_tokens=nseq * span, layout=lay, device=dev)
                npg = -(-(ctx if lay == "replicated" else -(-ctx // W)) // c.page_size)
                starts = torch.arange(nseq, device=dev, dtype=torch.int64).view(nsets, T) * span
                caches[lay] = (c, [c.block_table(starts[j], npg) for j in range(nsets)], span)
            for i in range(nseq):
                k8, ks = _random_keys(ctx, gen, dev)
                for c, _, span in caches.values():
                    c.write(i * span + torch.arange(ctx, device=dev), k8, ks)
            q = [(torch.randn(T, H, 128, generator=gen, device=dev) * 2).to(torch.float8_e4m3fn)]
            w = [torch.randn(T, H, generator=gen, device=dev) * H**-0.5 * 128**-0.5]
            for _ in range(nsets - 1):
                q.append(q[0][torch.randperm(T, generator=gen, device=dev)])
                w.append(w[0].flip(1).contiguous())
            lens = torch.full((T,), ctx, dtype=torch.int64, device=dev)
            variants = {
                "lib": lambda q, w, c, tab, L: indexer_logits(q, w, c, lens, block_table=tab, max_seq_len=ctx),
                "v1": lambda q, w, c, tab, L: _v1(q, w, c, lens, tab, L),
                "v1spec": lambda q, w, c, tab, L: _v1(q, w, c, lens, tab, L, spec=True),
                "v1np1": lambda q, w, c, tab, L: _v1(q, w, c, lens, tab, L, npage=1),
                "v1np4": lambda q, w, c, tab, L: _v1(q, w, c, lens, tab, L, npage=4),
                "v1w8": lambda q, w, c, tab, L: _v1(q, w, c, lens, tab, L, warps=8),
            }
            for name, fn in variants.items():
                row = {"ctx": ctx, "rows": T, "variant": name, "same": True}
                for lay, key in (("replicated", "rep"), ("owner_sharded", "sh")):
                    c, tabs, _ = caches[lay]
                    Lmax = tabs[0].shape[1] * c.page_size
                    Lq = min(Lmax, ctx if lay == "replicated" else -(-ctx // W))
                    for j in range(nsets):
                        ref = variants["lib"](q[j], w[j], c, tabs[j], Lq)
                        got = fn(q[j], w[j], c, tabs[j], Lq)
                        row["same"] &= bool(torch.equal(ref[:, :Lq], got[:, :Lq]))
                    row[key] = slowest_rank(
                        time_op(lambda i, c=c, tabs=tabs, Lq=Lq: fn(q[i % nsets], w[i % nsets], c, tabs[i % nsets], Lq),
                                calls=20, iters=cfg["iters"])
                    ).median  # fmt: skip
                row["ratio"] = row["sh"] / row["rep"]
                rows_out.append(row)
            for c, _, _ in caches.values():
                c.close()
            torch.cuda.empty_cache()
    return rows_out if dist.get_rank() == 0 else []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    res = run_ranks("scripts.diag.score_sweep:rank_main", 2, {"rows": a.rows, "contexts": a.contexts, "iters": a.iters})
    rows = res[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "score_sweep.json").write_text(json.dumps(rows, indent=1))
    print(format_table(rows, ["ctx", "rows", "variant", "same", "rep", "sh", "ratio"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
