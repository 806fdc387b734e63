"""Functions run on every rank by tests/test_sglang_*.py (module-level so spawn can pickle them).

Each rank loads SGLang's plugins (``load_plugins()``: entry point -> peerdcp's ``register``), builds SGLang's
own ``GroupCoordinator`` for the DCP group (gloo on CPU, NCCL on GPU; a plain-torch stand-in only if
SGLang's coordinator cannot be built here, reported in the result) and calls SGLang's own DCP functions.
Every rank generates *every* rank's inputs from the same seed, so the plain-torch references need no
communication.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

H_PER_RANK_DEFAULT = 2


class TorchGroup:
    """Stand-in with the ``GroupCoordinator`` members SGLang's DCP functions use, over a torch group."""

    def __init__(self, group: Any = None) -> None:
        self.device_group = group if group is not None else dist.group.WORLD
        self.cpu_group = None
        self.world_size = dist.get_world_size(self.device_group)
        self.rank_in_group = dist.get_rank(self.device_group)
        self.unique_name = "peerdcp-test-dcp"

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_to_all_single(output, input, group=self.device_group)

    def reduce_scatter_along_dim(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        chunks = [c.contiguous() for c in t.chunk(self.world_size, dim=dim)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=self.device_group)
        return out


def _setup(env: dict[str, str], backend: str) -> tuple[Any, str]:
    """Apply the test's env, load SGLang's plugins, and build the DCP group coordinator."""
    os.environ.update(env)
    from sglang.srt.plugins import load_plugins

    import peerdcp.integrations.sglang as plugin

    plugin.options.reset()
    load_plugins()
    plugin.register()  # no-op after load_plugins; applies the hooks itself where no entry point was found
    global _GC
    if _GC is not None:
        return _GC
    W = dist.get_world_size()
    rank = dist.get_rank()
    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        gc = GroupCoordinator(
            [list(range(W))],
            rank,  # local rank: one process per GPU on one host
            backend,
            use_pynccl=False,
            use_mscclpp=False,
            use_custom_allreduce=False,
            use_torch_symm_mem_all_reduce=False,
            use_hpu_communicator=False,
            use_xpu_communicator=False,
            group_name="dcp",
        )
        kind = "GroupCoordinator"
    except Exception as e:  # noqa: BLE001 - documented stand-in
        gc = TorchGroup()
        kind = f"TorchGroup (GroupCoordinator failed: {type(e).__name__}: {e})"
    _GC = (gc, kind)
    return _GC


_GC: tuple[Any, str] | None = None


def make_partials(seed: int, W: int, T: int, H: int, D: int, dtype: torch.dtype, device: str):
    """Every rank's ``[T, W*H, D]`` partial and ``[T, W*H]`` fp32 LSE. Some (token, head, source) are empty
    (-inf / NaN / +inf LSE with a NaN payload); token 0 head 0 is empty on every source."""
    g = torch.Generator().manual_seed(seed)
    outs, lses = [], []
    for _s in range(W):
        o = torch.randn(T, W * H, D, generator=g)
        lse = torch.randn(T, W * H, generator=g) * 3
        empty = torch.rand(T, W * H, generator=g) < 0.25
        kind = torch.randint(0, 3, (T, W * H), generator=g)
        bad = torch.tensor([float("-inf"), float("nan"), float("inf")])[kind]
        lse = torch.where(empty, bad, lse)
        o[empty] = float("nan")
        lse[0, ::H] = float("-inf")  # head 0 of every rank at token 0: all sources empty
        o[0, ::H] = float("nan")
        outs.append(o.to(dtype).to(device))
        lses.append(lse.to(device))
    return outs, lses


def merge_cases(env: dict[str, str], cases: list[dict], backend: str = "gloo") -> dict:
    """Call SGLang's own merge functions for each case (every one routed to peerdcp); check the result inside
    ``dcp_reduce_bounds`` (the fp32 error model around the fp64 value)."""
    from sglang.srt.layers import dcp as dcp_pkg
    from sglang.srt.layers.dcp import comm

    import peerdcp.integrations.sglang as plugin
    from peerdcp.output.reference import dcp_reduce, dcp_reduce_bounds, outside_bounds

    gc, kind = _setup(env, backend)
    W, r = gc.world_size, gc.rank_in_group
    device = "cuda" if backend != "gloo" else "cpu"
    results = []
    for c in cases:
        os.environ["PEERDCP_SGLANG_DCP_COMM_BACKEND"] = c["configured"]
        plugin.options.reset()
        before = dict(plugin.stats()["counts"])
        outs, lses = make_partials(c["seed"], W, c["T"], c["H"], c["D"], c["dtype"], device)
        base_e = c["base_e"]
        fn = {
            "a2a": comm.dcp_a2a_lse_reduce,
            "ag_rs": comm.cp_lse_ag_out_rs_mla,
            "ag_rs_pkg": dcp_pkg.cp_lse_ag_out_rs_mla,  # the binding forward_mla imports
        }[c["fn"]]
        kwargs = {"is_lse_base_on_e": base_e}
        if c.get("comm_backend") is not None:
            kwargs["comm_backend"] = c["comm_backend"]
        got = fn(outs[r], lses[r], gc, **kwargs)
        dtype_ok = got.dtype == c["dtype"]
        if c["fn"].startswith("ag_rs"):
            layout_ok = tuple(got.shape) == (c["H"], c["T"], c["D"])
            got = got.transpose(0, 1)
        else:
            layout_ok = tuple(got.shape) == (c["T"], c["H"], c["D"])
        cpu_outs, cpu_lses = [o.cpu() for o in outs], [x.cpu() for x in lses]
        base = "e" if base_e else 2
        ref = dcp_reduce(cpu_outs, cpu_lses, r, lse_base=base)
        lo, hi, _, _ = dcp_reduce_bounds(cpu_outs, cpu_lses, r, lse_base=base, out_dtype=c["dtype"])
        got = got.float().cpu()
        err = (got.double() - ref).abs()
        after = plugin.stats()["counts"]
        results.append(
            {
                "case": c["name"],
                "layout_ok": layout_ok,
                "dtype_ok": dtype_ok,
                "finite": bool(torch.isfinite(got).all()),
                "empty_row_zero": bool((got[0, 0] == 0).all()),
                "max_err": float(err.max()),
                "within_tol": not bool(outside_bounds(got, lo, hi).any()),
                "served": {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)},
            }
        )
    return {"group": kind, "results": results, "objects": plugin.stats()["objects"]}


def query_case(env: dict[str, str], seed: int, T: int, H: int, nope: int, rope: int, backend: str = "gloo") -> dict:
    """SGLang's own ``all_gather_q_for_mla_decode`` under ``--dcp-query-backend vmm_direct``."""
    from sglang.srt.layers.dcp import comm
    from sglang.srt.runtime_context import get_parallel

    import peerdcp.integrations.sglang as plugin

    gc, kind = _setup(env, backend)
    W, r = gc.world_size, gc.rank_in_group
    device = "cuda" if backend != "gloo" else "cpu"
    g = torch.Generator().manual_seed(seed)
    nopes = [torch.randn(T, H, nope, generator=g).to(torch.bfloat16).to(device) for _ in range(W)]
    pes = [torch.randn(T, H, rope, generator=g).to(torch.bfloat16).to(device) for _ in range(W)]
    before = plugin.stats()["counts"].get("query:vmm_direct", 0)
    with get_parallel().override(dcp_group=gc):
        q_nope, q_pe = comm.all_gather_q_for_mla_decode(nopes[r], pes[r])
    want_nope, want_pe = torch.cat(nopes, dim=1), torch.cat(pes, dim=1)
    diff = [
        (name, torch.nonzero(a.cpu().float() != b.cpu().float())[:4].tolist())
        for name, a, b in (("nope", q_nope, want_nope), ("pe", q_pe, want_pe))
        if a.shape == b.shape and not torch.equal(a.cpu(), b.cpu())
    ]
    return {
        "group": kind,
        "first_mismatches": diff,
        "shapes": [tuple(q_nope.shape), tuple(q_pe.shape)],
        "dtypes": [str(q_nope.dtype), str(q_pe.dtype)],
        "equal": bool(torch.equal(q_nope.cpu(), want_nope.cpu()) and torch.equal(q_pe.cpu(), want_pe.cpu())),
        "served": plugin.stats()["counts"].get("query:vmm_direct", 0) - before,
    }


def close_workspaces() -> dict:
    import peerdcp.integrations.sglang as plugin

    n = len(plugin.WORKSPACES.objects)
    plugin.WORKSPACES.close_all()
    return {"closed": n, "left": len(plugin.WORKSPACES.objects)}


def prepare_case(env: dict[str, str], heads: int, kv_lora_rank: int, rope: int, rows: int) -> dict:
    """The pre-capture step (``Workspaces.prepare``) on this group: objects created, or the start-up error."""
    import peerdcp.integrations.sglang as plugin

    gc, _ = _setup(env, "gloo")
    plugin.options.reset()
    try:
        plugin.WORKSPACES.prepare(
            gc,
            heads_per_rank=heads,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope,
            dtype=torch.bfloat16,
            lse_base=2,
            max_tokens=rows,
        )
        return {"error": None, "objects": plugin.stats()["objects"], "fallback": plugin.stats()["fallback"]}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "objects": plugin.stats()["objects"]}


# --- GPU (two H200s): parity with SGLang's own a2a ------------------------------------------------------------------
def _finite_partials(seed: int, W: int, T: int, H: int, D: int, dtype: torch.dtype, device: str):
    """Like :func:`make_partials`, but empty sources carry finite payloads: SGLang's a2a combine multiplies a
    zero weight by the payload (0*NaN = NaN), so parity with it needs finite bytes there."""
    g = torch.Generator().manual_seed(seed)
    outs, lses = [], []
    for _s in range(W):
        o = torch.randn(T, W * H, D, generator=g)
        lse = torch.randn(T, W * H, generator=g) * 3
        lse[torch.rand(T, W * H, generator=g) < 0.2] = float("-inf")
        lse[0, ::H] = float("-inf")  # every source empty for head 0 of each rank at token 0
        outs.append(o.to(dtype).to(device))
        lses.append(lse.to(device))
    return outs, lses


def _time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def gpu_merge_parity(env: dict[str, str], Ts: list[int], H: int, D: int, graph_T: int = 8) -> dict:
    """SGLang's own merge functions with the plugin routing to vmm and symm_a2a vs SGLang's own a2a (and
    ag_rs), eager and in a CUDA graph, on SGLang's NCCL GroupCoordinator."""
    from sglang.srt.layers.dcp import comm

    import peerdcp.integrations.sglang as plugin
    from peerdcp.output.reference import dcp_reduce

    gc, kind = _setup(env, "nccl")
    W, r = gc.world_size, gc.rank_in_group
    dev = f"cuda:{torch.cuda.current_device()}"
    cap = int(env.get("PEERDCP_SGLANG_MAX_TOKENS", "512"))
    sglang_agrs = plugin._ORIGINALS["cp_lse_ag_out_rs_mla"]
    rows = []
    for backend in ("vmm", "symm_a2a"):
        os.environ["PEERDCP_SGLANG_DCP_COMM_BACKEND"] = backend
        plugin.options.reset()
        for base_e in (False, True):
            for T in Ts:
                outs, lses = _finite_partials(1000 + T + 7 * base_e, W, T, H, D, torch.bfloat16, dev)
                o, l_ = outs[r], lses[r]
                before = dict(plugin.stats()["counts"])
                ref_a2a = comm.dcp_a2a_lse_reduce(o, l_, gc, is_lse_base_on_e=base_e, comm_backend="a2a")
                try:
                    via_agrs = comm.cp_lse_ag_out_rs_mla(o, l_, gc, is_lse_base_on_e=base_e)
                    agrs_error = None
                except Exception as e:  # noqa: BLE001 - above the workspace this is SGLang's own ag_rs
                    if cap >= T:  # within the workspace: must be served, so a failure is real
                        raise
                    via_agrs, agrs_error = ref_a2a.transpose(0, 1), f"{type(e).__name__}: {e}"
                via_a2a = comm.dcp_a2a_lse_reduce(o, l_, gc, is_lse_base_on_e=base_e, comm_backend=backend)
                try:
                    own_agrs = sglang_agrs(o, l_, gc, is_lse_base_on_e=base_e).transpose(0, 1)
                    agrs_err = float((own_agrs.float() - ref_a2a.float()).abs().max())
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    agrs_err = f"{type(e).__name__}: {e}"
                served = plugin.stats()["counts"].get(f"merge:{backend}", 0) - before.get(f"merge:{backend}", 0)
                ref = dcp_reduce([x.cpu() for x in outs], [x.cpu() for x in lses], r, lse_base="e" if base_e else 2)
                a = ref_a2a.float().cpu()
                row = {
                    "backend": backend,
                    "base": "e" if base_e else "2",
                    "T": T,
                    "served": served,
                    "sglang_agrs_error_above_workspace": agrs_error,
                    "shapes_ok": tuple(via_agrs.shape) == (H, T, D) and tuple(via_a2a.shape) == (T, H, D),
                    "agrs_vs_a2a": float((via_agrs.transpose(0, 1).float().cpu() - a).abs().max()),
                    "a2a_vs_a2a": float((via_a2a.float().cpu() - a).abs().max()),
                    "a2a_equal_when_unserved": bool(torch.equal(via_a2a.cpu(), ref_a2a.cpu())),
                    "sglang_agrs_vs_a2a": agrs_err,
                    "routed_vs_ref": float((via_a2a.double().cpu() - ref).abs().max()),
                    "sglang_a2a_vs_ref": float((a.double() - ref).abs().max()),
                    "ulp_ok": bool(
                        ((via_agrs.transpose(0, 1).float().cpu() - a).abs() <= 2**-7 * a.abs() + 2**-9).all()
                        and ((via_a2a.float().cpu() - a).abs() <= 2**-7 * a.abs() + 2**-9).all()
                    ),
                }
                if T in (1, 64, 256):
                    row["us_routed"] = _time_us(lambda: comm.cp_lse_ag_out_rs_mla(o, l_, gc, is_lse_base_on_e=base_e))
                    row["us_sglang_a2a"] = _time_us(
                        lambda: comm.dcp_a2a_lse_reduce(o, l_, gc, is_lse_base_on_e=base_e, comm_backend="a2a")
                    )
                rows.append(row)
        # CUDA graph through SGLang's call path: capture once, replay with fresh inputs
        T = graph_T
        outs, lses = _finite_partials(77, W, T, H, D, torch.bfloat16, dev)
        s_o, s_l = outs[r].clone(), lses[r].clone()
        comm.cp_lse_ag_out_rs_mla(s_o, s_l, gc, is_lse_base_on_e=False)  # workspace exists before capture
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            g_out = comm.cp_lse_ag_out_rs_mla(s_o, s_l, gc, is_lse_base_on_e=False)
        graph_ok = []
        for seed in (78, 79, 80):
            outs, lses = _finite_partials(seed, W, T, H, D, torch.bfloat16, dev)
            s_o.copy_(outs[r])
            s_l.copy_(lses[r])
            g.replay()
            want = comm.dcp_a2a_lse_reduce(outs[r], lses[r], gc, is_lse_base_on_e=False, comm_backend="a2a")
            got = g_out.transpose(0, 1).float()
            graph_ok.append(bool(((got - want.float()).abs() <= 2**-7 * want.float().abs() + 2**-9).all()))
        rows.append({"backend": backend, "graph_T": T, "graph_ok": graph_ok})
        del g
    return {"group": kind, "rows": rows, "objects": plugin.stats()["objects"]}


def gpu_query_parity(env: dict[str, str], Ts: list[int], H: int) -> dict:
    """SGLang's all_gather_q_for_mla_decode routed to QueryGather vs SGLang's own NCCL gather: equal values."""
    from sglang.srt.layers.dcp import comm
    from sglang.srt.runtime_context import get_parallel

    import peerdcp.integrations.sglang as plugin

    gc, kind = _setup(env, "nccl")
    os.environ["PEERDCP_SGLANG_DCP_QUERY_BACKEND"] = "vmm_direct"
    plugin.options.reset()
    own = plugin._ORIGINALS["all_gather_q_for_mla_decode"]
    r = gc.rank_in_group
    out = []
    with get_parallel().override(dcp_group=gc):
        for T in Ts:
            g = torch.Generator().manual_seed(500 + T)
            nopes = [torch.randn(T, H, 512, generator=g).to(torch.bfloat16).cuda() for _ in range(gc.world_size)]
            pes = [torch.randn(T, H, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(gc.world_size)]
            before = plugin.stats()["counts"].get("query:vmm_direct", 0)
            qn, qp = comm.all_gather_q_for_mla_decode(nopes[r], pes[r])
            served = plugin.stats()["counts"].get("query:vmm_direct", 0) - before
            wn, wp = own(nopes[r], pes[r])
            out.append({"T": T, "served": served, "equal": bool(torch.equal(qn, wn) and torch.equal(qp, wp))})
    return {"group": kind, "rows": out}
