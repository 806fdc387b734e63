"""One DCP decode step of one MLA (optionally DSA) attention layer, run on every rank of a group.

The real path (what ``peerdcp run`` executes, one process per GPU or CPU processes over host memory)::

    x [T, hidden] --(this rank's q projection)--> q_nope [T, H, nope], q_pe [T, H, rope]   (H heads per rank)
      --QueryGather-->  q [T, W*H, nope+rope] bf16 (roped)
    DSA: indexer q8/weights (replicated) --indexer_logits over the owner-sharded IndexKCache--> local logits
      --TopK.select--> ids [T, topk] global --TopK.owned--> local KV rows
    attention over the local KV shard (plain torch) --> partial out [T, W*H, nope], lse [T, W*H]
      --OutputReducer--> out [T, H, nope]  (this rank's heads)

and the same step unsharded on each rank (all weights and the whole KV are known to every rank, drawn
from one seed): reference query, full-sequence scores on a *replicated* cache with the same scoring
kernel (so scores are bitwise equal) + canonical top-k, attention over the full KV. The checks: same
top-k ids (set and order), the query's bytes (the fp32 rounding contract), the merged output inside the fp32
error-model bound of every rank's partials (``dcp_reduce_bounds``; the exchange itself), and the output within a
bf16 tolerance of the unsharded attention (end to end).

State lives in the worker process between phases (``_S``), so the driver can show progress per phase.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from ..output.partial import partial_attention
from .geometry import Geometry

__all__ = ["setup", "generate", "forward", "check", "timings", "gpu_burst_us", "capacity", "teardown"]

_S: dict[str, Any] = {}
FAULTS = ("none", "corrupt-partial", "corrupt-query", "corrupt-topk", "corrupt-merge")


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rope_table(g: Geometry, device: torch.device) -> torch.Tensor:
    from ..query.rope import PRESETS, YarnParams, cos_sin_cache

    if g.rope.startswith("plain:"):
        p = YarnParams(theta=float(g.rope.split(":")[1]), rope_dim=g.rope_dim, max_pos=g.max_positions)
    else:
        p = dataclasses.replace(PRESETS[g.rope], rope_dim=g.rope_dim)
    return cos_sin_cache(p, max_pos=g.max_positions, device=device)


def setup(geom: dict, rows: int, context: int, backends: dict, memory: str, seed: int, fault: str) -> dict:
    """Create the peerdcp objects (collective, before any capture) and remember the configuration."""
    from ..output import OutputReducer
    from ..query import QueryGather

    g = Geometry(**geom)
    W, r = dist.get_world_size(), dist.get_rank()
    if g.heads % W:
        raise ValueError(f"{g.name}: {g.heads} heads do not split over {W} ranks")
    dev = _dev()
    H = g.heads // W
    mem = memory if dev.type == "cuda" else "host"
    _S.clear()
    _S.update(g=g, W=W, r=r, H=H, T=rows, L=context, dev=dev, seed=seed, fault=fault, timings={})
    qg = QueryGather(
        None, max_tokens=rows, heads_per_rank=H, nope_dim=g.nope_dim, rope_dim=g.rope_dim,
        rope_style="interleaved", out_dtype=torch.bfloat16, backend=backends["query"], memory=mem, timeout_s=30.0,
    )  # fmt: skip
    red = OutputReducer(
        None, max_tokens=rows, heads_per_rank=H, head_dim=g.nope_dim, dtype=torch.bfloat16,
        backend=backends["output"], memory=mem, lse_base="e", timeout_s=30.0,
    )  # fmt: skip
    _S.update(qg=qg, red=red)
    info = {
        "query": {"backend": qg.backend, "memory": qg.memory, "reason": qg.reason},
        "output": {"backend": red.backend, "memory": red.memory, "reason": red.reason},
    }
    if g.dsa:
        from ..topk import IndexKCache, TopK

        tk = TopK(None, max_rows=rows, topk=g.topk, backend=backends["topk"], memory=mem, timeout_s=30.0)
        cache = IndexKCache(None, capacity_tokens=rows * _stride(context, W), head_dim=g.index_dim,
                            layout="owner_sharded", device=dev)  # fmt: skip
        rep = IndexKCache(None, capacity_tokens=rows * _stride(context, W), head_dim=g.index_dim,
                          layout="replicated", device=dev)  # fmt: skip
        _S.update(tk=tk, cache=cache, rep=rep)
        info["topk"] = {"backend": tk.backend, "memory": tk.memory, "reason": tk.reason}
        info["indexer"] = {"layout": cache.layout, "reason": cache.reason}
    info["device"] = str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    return info


def _stride(context: int, W: int) -> int:
    """Logical slots between consecutive sequences in the index-K caches: the context rounded up to
    IndexKCache.seq_align for interleave 1 and 64-token pages (checked against the object in _index_logits)."""
    align = W * 64
    return -(-context // align) * align


def _index_logits(cache, *, write: bool) -> torch.Tensor:
    """Indexer scores of every row against ``cache`` (one sequence per row, at slot ``t * _stride``);
    ``write`` first stores the whole random key history (the cache keeps what its layout owns)."""
    from ..topk import indexer_logits

    g, W, T, L, dev = (_S[k] for k in ("g", "W", "T", "L", "dev"))
    if _stride(1, W) % cache.seq_align:
        raise RuntimeError(
            f"sequence stride {_stride(1, W)} is not a multiple of IndexKCache.seq_align {cache.seq_align}"
        )
    starts = torch.arange(T, device=dev) * _stride(L, W)
    if write:
        slots = (starts[:, None] + torch.arange(L, device=dev)[None, :]).reshape(-1)
        cache.write(slots, _S["k_idx"].reshape(-1, g.index_dim), _S["k_scale"].reshape(-1))
    rows = -(-L // W) if cache.layout == "owner_sharded" else L
    bt = cache.block_table(starts, -(-rows // cache.page_size))
    return indexer_logits(_S["q_idx"], _S["w_idx"], cache, _S["lens"], block_table=bt, max_seq_len=L)


def generate() -> dict:
    """Random weights, activations and KV history, identical on every rank (one seed)."""
    g, W, r, H, T, L, dev = (_S[k] for k in ("g", "W", "r", "H", "T", "L", "dev"))
    gen = torch.Generator(device=dev).manual_seed(_S["seed"])

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * scale).to(dtype)

    D = g.nope_dim + g.rope_dim
    x = randn(T, g.hidden)
    wq = randn(g.hidden, g.heads * D, scale=g.hidden**-0.5)
    # ragged context: row t attends L_t tokens (the last row has fewer than top-k on the CPU geometry)
    lens = torch.tensor([max(1, L - (t * L) // (2 * max(T, 1))) for t in range(T)], dtype=torch.int64)
    if g.dsa and T > 1:
        lens[-1] = max(1, min(int(lens[-1]), g.topk // 2))
    positions = (lens - 1).to(dev)
    c_kv = randn(T, L, g.nope_dim)
    k_pe = randn(T, L, g.rope_dim)
    _S.update(x=x, wq=wq, lens=lens.to(dev), positions=positions, c_kv=c_kv, k_pe=k_pe, cos_sin=_rope_table(g, dev))
    if g.dsa:
        from ..query.reference import quantize_fp8

        qi = torch.randn(T, g.index_heads, g.index_dim, generator=gen, device=dev)
        _S["q_idx"] = quantize_fp8(qi * 40)  # FP8 indexer query, spread over the e4m3 range
        _S["w_idx"] = torch.randn(T, g.index_heads, generator=gen, device=dev) * (g.index_heads * g.index_dim) ** -0.5
        # few distinct key values: heavy score ties, so the canonical tie-break matters
        k = torch.randint(-3, 4, (T, L, g.index_dim), generator=gen, device=dev).float() * 16
        _S["k_idx"] = quantize_fp8(k)
        _S["k_scale"] = torch.exp2(torch.randint(-2, 2, (T, L), generator=gen, device=dev).float())
    nbytes_kv = T * L * D * 2
    return {"kv_bytes_replicated": nbytes_kv, "lens": lens.tolist()}


def _local_kv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's KV rows (interleave 1: token g on rank g % W at row g // W) and their local lengths."""
    W, r, L = _S["W"], _S["r"], _S["L"]
    idx = torch.arange(r, L, W, device=_S["dev"])
    local_len = (_S["lens"] - r + W - 1).clamp(min=0) // W
    return _S["c_kv"][:, idx], _S["k_pe"][:, idx], local_len


def forward() -> dict:
    """The sharded step through the three mechanisms (what a serving engine runs per layer)."""
    g, W, r, H, T = (_S[k] for k in ("g", "W", "r", "H", "T"))
    q_nope, q_pe = _shard_of(_S["r"])
    if _S["fault"] == "corrupt-query" and r == W - 1:
        q_pe = q_pe.flip(-1).contiguous()
    q = _S["qg"].gather(q_nope, q_pe, _S["positions"], _S["cos_sin"])
    c_loc, pe_loc, local_len = _local_kv()
    out: dict[str, Any] = {}
    if g.dsa:
        logits = _index_logits(_S["cache"], write=True)
        if _S["fault"] == "corrupt-topk" and r == 0:
            logits = logits.flip(-1).contiguous()
        ids = _S["tk"].select(logits, _S["lens"])
        rows, counts = _S["tk"].owned(ids)
        # attention over the selected local rows only
        safe = rows.clamp(min=0).long()
        c_sel = torch.gather(c_loc, 1, safe[..., None].expand(-1, -1, g.nope_dim))
        pe_sel = torch.gather(pe_loc, 1, safe[..., None].expand(-1, -1, g.rope_dim))
        valid = rows >= 0
        out.update(ids=ids, logits_shape=list(logits.shape))
        _S["ids"] = ids
    else:
        c_sel, pe_sel = c_loc, pe_loc
        valid = torch.arange(c_loc.shape[1], device=_S["dev"])[None, :] < local_len[:, None]
    part, lse = partial_attention(q, c_sel, pe_sel, valid, g.softmax_scale)
    if _S["fault"] == "corrupt-partial" and r == W - 1:
        part = (part.float() * 1.5 + 0.25).to(part.dtype)
    merged = _S["red"].reduce(part.contiguous(), lse.contiguous())
    if _S["fault"] == "corrupt-merge" and r == 0:  # two bf16 steps on the largest element: below the rel-err check
        flat = merged.view(-1)
        i = int(flat.float().abs().argmax())
        flat[i] = (flat[i : i + 1].view(torch.int16) + 2).view(torch.bfloat16)[0]
    _sync()
    _S.update(q=q, merged=merged, part=part, lse=lse, valid=valid)
    return {"q_shape": list(q.shape), "out_shape": list(merged.shape), "local_keys": int(valid.sum())}


def check() -> dict:
    """The same step unsharded (fp32 math), compared with the sharded result."""
    from ..query.reference import widened_query

    g, W, r, H, T = (_S[k] for k in ("g", "W", "r", "H", "T"))
    shards = [_shard_of(s) for s in range(W)]
    q_ref = widened_query([a for a, _ in shards], [b for _, b in shards], _S["positions"], _S["cos_sin"],
                          rope_style="interleaved", out_dtype=torch.bfloat16)  # fmt: skip
    q = _S["q"]
    q_diff = (q.float() - q_ref.float()).abs()
    # every Query path follows the reference's fp32 rounding contract, so the gathered query is its bytes exactly
    same = torch.equal(q.view(torch.int16), q_ref.view(torch.int16))
    res: dict[str, Any] = {"query_ok": bool(same), "query_max_abs": float(q_diff.max())}
    L = _S["L"]
    if g.dsa:
        from ..topk.candidates import canonical_topk

        full = _index_logits(_S["rep"], write=True)
        ids_ref = canonical_topk(full, _S["lens"], g.topk)
        res["topk_equal"] = bool(torch.equal(ids_ref, _S["ids"]))
        res["topk_selected"] = int((ids_ref >= 0).sum())
        sel = ids_ref.long()
        valid = sel >= 0
        c = torch.gather(_S["c_kv"], 1, sel.clamp(min=0)[..., None].expand(-1, -1, g.nope_dim))
        pe = torch.gather(_S["k_pe"], 1, sel.clamp(min=0)[..., None].expand(-1, -1, g.rope_dim))
    else:
        c, pe = _S["c_kv"], _S["k_pe"]
        valid = torch.arange(L, device=_S["dev"])[None, :] < _S["lens"][:, None]
    mine = q_ref[:, r * H : (r + 1) * H]
    ref32 = _ref_out_fp32(mine, c, pe, valid, g.softmax_scale)
    got = _S["merged"].float()
    rel = float((got - ref32).norm() / ref32.norm().clamp(min=1e-30))
    res.update(
        output_rel_err=rel,
        output_ok=bool(rel <= 1e-2 and torch.isfinite(got).all()),
        output_nan=bool(torch.isnan(got).any()),
    )
    res["merge_outside"] = _merge_outside()
    res["ok"] = res["query_ok"] and res["output_ok"] and res["merge_outside"] == 0 and res.get("topk_equal", True)
    return res


def _merge_outside() -> int:
    """Elements of this rank's merged output outside ``dcp_reduce_bounds`` of every rank's partial (all-gathered
    over the default group's CPU path): the Output exchange checked on its own, at the fp32 error model."""
    from ..output.reference import dcp_reduce_bounds, outside_bounds

    W, r = _S["W"], _S["r"]
    part, lse = _S["part"].cpu().contiguous(), _S["lse"].cpu().contiguous()
    parts = [torch.empty_like(part) for _ in range(W)]
    lses = [torch.empty_like(lse) for _ in range(W)]
    dist.all_gather([p.view(torch.uint8) for p in parts], part.view(torch.uint8))  # bf16 as bytes (gloo)
    dist.all_gather(lses, lse)
    lo, hi, _, _ = dcp_reduce_bounds(parts, lses, r, lse_base="e", out_dtype=part.dtype)
    return int(outside_bounds(_S["merged"].cpu(), lo, hi).sum())


def _ref_out_fp32(q, c, pe, valid, scale) -> torch.Tensor:
    nope = c.shape[-1]
    s = torch.einsum("thd,tnd->thn", q.float()[..., :nope], c.float())
    s = (s + torch.einsum("thd,tnd->thn", q.float()[..., nope:], pe.float())) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("thn,tnd->thd", p, c.float())


def _shard_of(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g, H = _S["g"], _S["H"]
    D = g.nope_dim + g.rope_dim
    q = (_S["x"] @ _S["wq"][:, s * H * D : (s + 1) * H * D]).view(_S["T"], H, D)
    return q[..., : g.nope_dim].contiguous(), q[..., g.nope_dim :].contiguous()


def timings(reps: int) -> dict:
    """Per-mechanism time of the chosen backend against its collective baseline, in the same process."""
    from ..output import OutputReducer
    from ..query import QueryGather

    g, W, H, T, dev = (_S[k] for k in ("g", "W", "H", "T", "dev"))
    q_nope, q_pe = _shard_of(_S["r"])
    qg_base = QueryGather(None, max_tokens=T, heads_per_rank=H, nope_dim=g.nope_dim, rope_dim=g.rope_dim,
                          out_dtype=torch.bfloat16, backend="allgather")  # fmt: skip
    red_base = OutputReducer(None, max_tokens=T, heads_per_rank=H, head_dim=g.nope_dim, dtype=torch.bfloat16,
                             backend="a2a")  # fmt: skip
    part, lse = _S["part"].contiguous(), _S["lse"].contiguous()
    cases = {
        "query": (lambda: _S["qg"].gather(q_nope, q_pe, _S["positions"], _S["cos_sin"]),
                  lambda: qg_base.gather(q_nope, q_pe, _S["positions"], _S["cos_sin"])),
        "output": (lambda: _S["red"].reduce(part, lse), lambda: red_base.reduce(part, lse)),
    }  # fmt: skip
    objs = [qg_base, red_base]
    if g.dsa:
        from ..topk import TopK

        tk_base = TopK(None, max_rows=T, topk=g.topk, backend="allgather", device=dev)
        objs.append(tk_base)
        logits = _index_logits(_S["cache"], write=False)
        cases["topk"] = (lambda: _S["tk"].select(logits, _S["lens"]), lambda: tk_base.select(logits, _S["lens"]))
    out = {}
    for name, (fn, base) in cases.items():
        out[name] = {"peerdcp_us": _time(fn, reps), "baseline_us": _time(base, reps)}
    for o in objs:
        o.close()
    return out


_BURST = 10  # back-to-back eager calls per GPU timing sample (see _time)


def gpu_burst_us(fn, calls: int) -> float:
    """Microseconds per call of ``calls`` back-to-back calls of ``fn`` on the current stream (CUDA events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def _time(fn, reps: int) -> float:
    """Median microseconds per call (eager; slowest rank).

    A GPU sample is ``_BURST`` back-to-back calls after a barrier, divided by ``_BURST``: the ranks leave the
    (gloo) barrier at different times and every exchange, direct or collective, waits for the last rank, so a
    one-call sample adds that skew to the call; a burst spreads it over ``_BURST`` calls. An engine makes its calls
    with no barrier between them, as a burst does. CPU samples stay one call (the interpreter takes milliseconds)."""
    # warm-up: builds and caches the GPU kernels; on CPU (the interpreter, nothing to build) one call checks the path
    gpu = torch.cuda.is_available()
    for _ in range(2 if gpu else 1):
        fn()
    _sync()
    samples = []
    for _ in range(reps):
        dist.barrier()
        if gpu:
            samples.append(gpu_burst_us(fn, _BURST))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    med = torch.tensor(samples).median().item()
    t = torch.tensor([med], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo-capable: CPU tensor on the default group
    return float(t.item())


def capacity() -> dict:
    g, W, r, T, L = (_S[k] for k in ("g", "W", "r", "T", "L"))
    D = g.nope_dim + g.rope_dim
    kv_local = (_S["lens"].cpu() - r + W - 1).clamp(min=0) // W
    res = {
        "kv_tokens_local": int(kv_local.sum()),
        "kv_tokens_logical": int(_S["lens"].sum()),
        "kv_bytes_local": int(kv_local.sum()) * D * 2,
        "kv_bytes_replicated": int(_S["lens"].sum()) * D * 2,
    }
    if g.dsa:
        res["index_k"] = _S["cache"].capacity_report()
        res["index_k_bytes_local"] = int(_S["cache"].nbytes)
        res["index_k_bytes_replicated"] = int(_S["rep"].nbytes)
    return res


def teardown() -> bool:
    for k in ("qg", "red", "tk", "cache", "rep"):
        if k in _S:
            _S[k].close()
    _S.clear()
    return True
