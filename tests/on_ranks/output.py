"""Functions run on every rank by tests/test_output.py and tests/test_output_gpu.py (module-level for spawn).

Every rank generates *all* ranks' inputs from the same seed, so each rank can compute the fp64 reference
for its own heads locally (``reference.dcp_reduce``) and no barrier is needed between calls.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time

import torch
import torch.distributed as dist

import peerdcp
from peerdcp.errors import PeerTimeoutError
from peerdcp.output.policy import DEFAULT_POLICY, OutputPolicy
from peerdcp.output.reference import combine, combine_bounds, dcp_reduce, dcp_reduce_bounds, outside_bounds

# Whole-output relative (Frobenius) error bound of one rounding to the output dtype (unit roundoff 2^-8 for
# bf16, 2^-11 for fp16): a run-wide check beside the per-element one (``combine_bounds``).
TOL = {torch.bfloat16: 2e-3, torch.float16: 5e-4}


def make_inputs(seed: int, W: int, T: int, H: int, D: int, dtype: torch.dtype, adversarial: bool = True):
    """All ranks' ``partial_out [T, W*H, D]`` and ``partial_lse [T, W*H]`` (CPU), deterministic in ``seed``.

    Adversarial: -inf / NaN / +inf LSE entries (their payloads are NaN: they must never be read), rows
    where every source is empty (NaN payloads everywhere), and rows with huge LSE gaps. The NaN payloads mix
    the canonical NaN with the bit pattern 0xFFFF (also a NaN; the CUDA sentinel kernel's rest marker, which
    a producer must rewrite, or its consumer would wait for that vector forever).
    """
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(T, W * H, D, generator=g).to(dtype) for _ in range(W)]
    lses = [torch.randn(T, W * H, generator=g) * 4.0 for _ in range(W)]
    if adversarial and T > 0:
        bits = torch.where(torch.arange(D) % 3 == 0, -1, 0x7FC0).to(torch.int16)  # 0xFFFF, 0x7FC0 (both NaN)
        nan_payload = bits.view(dtype)
        for s in range(W):
            u = torch.rand(T, W * H, generator=g)
            lses[s][u < 0.08] = float("-inf")
            lses[s][(u >= 0.08) & (u < 0.14)] = float("nan")
            lses[s][(u >= 0.14) & (u < 0.18)] = float("inf")
            gap = torch.rand(T, W * H, generator=g) < 0.1  # huge gaps: this source dominates or vanishes
            lses[s][gap] += torch.where(torch.rand(int(gap.sum()), generator=g) < 0.5, 300.0, -300.0)
        # rows where every source is empty
        empty = torch.rand(T, W * H, generator=g) < 0.1
        kinds = torch.randint(0, 3, (T, W * H), generator=g)
        for s in range(W):
            fill = torch.tensor([float("-inf"), float("nan"), float("inf")])[kinds]
            lses[s] = torch.where(empty, fill, lses[s])
        for s in range(W):
            bad = ~torch.isfinite(lses[s]) | (lses[s] == float("-inf"))
            outs[s][bad] = nan_payload
    return outs, lses


def check_result(out, lse, bounds, ref) -> dict:
    """``out`` (and ``lse``, or None) against ``bounds = dcp_reduce_bounds(...)`` (the interval the fp32 error
    model allows around the fp64 value, ``peerdcp.output.reference.combine_bounds``): elements outside it,
    NaN/inf outputs, exact zeros in rows where every source is empty (reference row 0), and for the
    run-wide relative error the squared norms of the difference to ``ref`` (fp64)."""
    lo, hi, llo, lhi = (b.to("cpu") for b in bounds)
    got = out.detach().to("cpu")
    ref = ref.detach().to("cpu", torch.float64)
    nan = int(torch.isnan(got).sum()) + int(torch.isinf(got).sum())
    g = got.to(torch.float64)
    outside = int(outside_bounds(g, lo, hi).sum())
    diff = (g - ref).nan_to_num(nan=1e30, posinf=1e30, neginf=1e30)
    sq_err, sq_ref = float(diff.pow(2).sum()), float(ref.pow(2).sum())
    empty_rows = ref.norm(dim=-1) == 0
    zero_ok = bool((g[empty_rows] == 0).all())
    ok = nan == 0 and zero_ok and outside == 0
    res = {"outside": outside, "nan": nan, "zero_ok": zero_ok, "ok": ok, "sq_err": sq_err, "sq_ref": sq_ref}
    if lse is not None:
        lse = lse.detach().to("cpu")
        # an all-empty row's interval is -inf alone: a finite or NaN LSE there is outside too
        lse_outside = int(outside_bounds(lse, llo, lhi).sum())
        res.update(lse_outside=lse_outside, lse_nan=int(torch.isnan(lse).sum()))
        res["ok"] = res["ok"] and lse_outside == 0
    return res


def _device(memory: str) -> str:
    return "cpu" if memory == "host" else f"cuda:{torch.cuda.current_device()}"


def run_cases(config: dict, cases: list[dict], seed: int) -> list[dict]:
    """One reducer (``config`` = constructor kwargs), many calls: each case ``{T, return_lse, adversarial}``.
    Returns one row per call (strict per-element check) and a last row with the run's relative error.

    Calls follow each other with new inputs and no barrier; outputs are poisoned (NaN) through the
    reducer's own fresh allocation, so a missed write shows up as NaN.
    """
    W, rank = dist.get_world_size(), dist.get_rank()
    dev = _device(config.get("memory", "host")) if config.get("backend") == "direct" else config.get("device", "cpu")
    kw = dict(config)
    kw.setdefault("device", dev)
    res = []
    with peerdcp.OutputReducer(None, **kw) as red:
        H, D, dtype = red.heads, red.head_dim, red.dtype
        for i, c in enumerate(cases):
            outs, lses = make_inputs(seed * 1000 + i, W, c["T"], H, D, dtype, c.get("adversarial", True))
            po = outs[rank].to(red.device)
            pl = lses[rank].to(red.device)
            rl = c.get("return_lse", False)
            got = red.reduce(po, pl, return_lse=rl)
            ref = dcp_reduce(outs, lses, rank, lse_base=red.lse_base)
            bounds = dcp_reduce_bounds(outs, lses, rank, lse_base=red.lse_base, out_dtype=dtype)
            got, lse = got if rl else (got, None)
            r = check_result(got, lse, bounds, ref)
            r.update(T=c["T"], i=i)
            res.append(r)
        info = {"backend": red.backend, "memory": red.memory, "kernel": red.kernel, "reason": red.reason}
        # the relative (Frobenius) error over every call of the run: one rounding to the output dtype
        rel = (sum(r["sq_err"] for r in res) / max(sum(r["sq_ref"] for r in res), 1e-30)) ** 0.5
        res.append({"T": -1, "rel": rel, "ok": rel <= TOL[dtype]})
    return [dict(r, **info) for r in res]


def bad_inputs(config: dict) -> list[str]:
    """Each bad call must raise TypeError/ValueError before any launch; returns 'Type: message' lines."""
    W = dist.get_world_size()
    msgs = []
    with peerdcp.OutputReducer(None, **config) as red:
        H, D, dev, dt = red.heads, red.head_dim, red.device, red.dtype
        T = 3
        good_o = torch.zeros(T, W * H, D, dtype=dt, device=dev)
        good_l = torch.zeros(T, W * H, dtype=torch.float32, device=dev)
        big = red.max_tokens + 1
        big_o = torch.zeros(big, W * H, D, dtype=dt, device=dev)
        big_l = torch.zeros(big, W * H, device=dev)
        bad = [
            ("list", [0], good_l, False),
            ("float32 out", good_o.float(), good_l, False),
            ("fp16 lse", good_o, good_l.half(), False),
            ("rank-2 out", good_o[:, :, 0], good_l, False),
            ("wrong heads", torch.zeros(T, W * H + 1, D, dtype=dt, device=dev), good_l, False),
            ("wrong D", torch.zeros(T, W * H, D + 1, dtype=dt, device=dev), good_l, False),
            ("lse shape", good_o, torch.zeros(T + 1, W * H, device=dev), False),
            ("too many tokens", big_o, big_l, False),
            ("non-contiguous out", torch.zeros(W * H, T, D, dtype=dt, device=dev).transpose(0, 1), good_l, False),
            ("non-contiguous lse", good_o, torch.zeros(W * H, T, device=dev).t(), False),
            ("return_lse not bool", good_o, good_l, 1),
        ]  # fmt: skip
        if dev.type == "cuda":
            bad.append(("wrong device", good_o.cpu(), good_l.cpu(), False))
        else:
            bad.append(("lse as int", good_o, good_l.to(torch.int32), False))
        for name, o, l, rl in bad:
            try:
                red.reduce(o, l, return_lse=rl)
                msgs.append(f"{name}: no error")
            except (TypeError, ValueError) as e:
                msgs.append(f"{name}: {type(e).__name__}: {e}")
        # T = 0 is valid and touches nothing
        e0 = red.reduce(good_o[:0], good_l[:0])
        msgs.append(f"empty: {tuple(e0.shape)}")
    try:
        red.reduce(good_o, good_l)
        msgs.append("closed: no error")
    except ValueError as e:
        msgs.append(f"closed: ValueError: {e}")
    red.close()  # idempotent
    return msgs


def bad_construct(kwargs_by_rank: list[dict]) -> str:
    """Construct with per-rank kwargs; returns 'Type: message' (every rank must raise)."""
    kw = kwargs_by_rank[dist.get_rank()]
    try:
        peerdcp.OutputReducer(None, **kw).close()
        return "no error"
    except (TypeError, ValueError, peerdcp.PeerSetupError) as e:
        return f"{type(e).__name__}: {e}"


def missing_peer(config: dict, absent: int, timeout_s: float) -> dict:
    """Rank ``absent`` never calls reduce: the others must raise PeerTimeoutError within the timeout, then
    refuse every later call with the same error."""
    rank, W = dist.get_rank(), dist.get_world_size()
    red = peerdcp.OutputReducer(None, timeout_s=timeout_s, **config)
    H, D = red.heads, red.head_dim
    res: dict = {}
    try:
        # one good round first (everybody present), so the timeout hits a live protocol
        outs, lses = make_inputs(7, W, 2, H, D, red.dtype)
        red.reduce(outs[rank].to(red.device), lses[rank].to(red.device))
        red.check()
        dist.barrier(group=red._info.cpu_group)
        if rank == absent:
            time.sleep(timeout_s * 2 + 1.0)
            res["absent"] = True
        else:
            t0 = time.time()
            try:
                red.reduce(outs[rank].to(red.device), lses[rank].to(red.device))
                red.check()
                res["first"] = "no error"
            except PeerTimeoutError as e:
                res["first"] = f"rank={e.rank} peer={e.peer} mech={e.mechanism}"
            res["dt"] = time.time() - t0
            try:
                red.reduce(outs[rank].to(red.device), lses[rank].to(red.device))
                res["second"] = "no error"
            except PeerTimeoutError as e:
                res["second"] = f"rank={e.rank} peer={e.peer} mech={e.mechanism}"
            try:
                red.check()
                res["check"] = "no error"
            except PeerTimeoutError:
                res["check"] = "PeerTimeoutError"
    finally:
        red.close()
    return res


def _bits_vs_reference(red, outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """This rank's ``reduce`` of every rank's ``outs`` / ``lses`` against the fp64 reference rounded once to the
    output dtype: ``(expected output, number of elements whose bits differ)``."""
    rank = dist.get_rank()
    got = red.reduce(outs[rank].to(red.device), lses[rank].to(red.device)).cpu()
    expect = dcp_reduce(outs, lses, rank).to(red.dtype)
    return expect, int((got.view(torch.int16) != expect.view(torch.int16)).sum())


def rounding_ties(config: dict, seed: int) -> dict:
    """W = 2, every (token, head) gets two equal LSEs and two adjacent values a, b of the output dtype, so the
    exact result (a + b) / 2 is a tie of that dtype: it must round to even, bit for bit as torch rounds the fp64
    reference (the interpreter's own fp32 -> bf16 cast truncates; ``_runtime.device.cast_rne`` rounds by hand)."""
    W = dist.get_world_size()
    with peerdcp.OutputReducer(None, **config) as red:
        T, H, D, dtype = red.max_tokens, red.heads, red.head_dim, red.dtype
        g = torch.Generator().manual_seed(seed)
        a = (torch.randn(T, W * H, D, generator=g) * 8).to(dtype)
        b = (a.view(torch.int16) + 1).view(dtype)  # the next value away from 0: (a + b) / 2 is exact in fp32, a tie
        lse = (torch.randn(T, W * H, generator=g) * 4).float()
        expect, mismatch = _bits_vs_reference(red, [a, b], [lse, lse.clone()])
        return {"mismatch": mismatch, "ties": expect.numel(), "backend": red.backend}


def subnormal_payloads(config: dict, seed: int) -> dict:
    """bf16 payloads that are subnormal (|x| < 2^-126) from every source, equal LSEs: the result must equal the
    fp64 reference rounded once, bit for bit (Triton 3.6's interpreter converts bf16 subnormals wrongly both ways;
    ``_runtime.device.to_f32`` / ``cast_rne`` go through the bits there)."""
    W = dist.get_world_size()
    with peerdcp.OutputReducer(None, **config) as red:
        T, H, D, dtype = red.max_tokens, red.heads, red.head_dim, red.dtype
        g = torch.Generator().manual_seed(seed)
        outs = [(torch.randn(T, W * H, D, generator=g) * 1e-39).to(dtype) for _ in range(W)]
        expect, mismatch = _bits_vs_reference(red, outs, [torch.zeros(T, W * H) for _ in range(W)])
        subnormal = int((expect.abs() < 2.0**-126).sum())
        return {"mismatch": mismatch, "subnormal": subnormal, "backend": red.backend}


def mismatched_tokens(config: dict, timeout_s: float) -> dict:
    """One good call, then rank 0 calls with T = 2 and the others with T = 3 (a usage error): the flag carries T,
    so the ranks' waits must time out (PeerTimeoutError) instead of combining stale rows of the inbox."""
    W, rank = dist.get_world_size(), dist.get_rank()
    res: dict = {}
    with peerdcp.OutputReducer(None, **dict(config, timeout_s=timeout_s)) as red:
        H, D = red.heads, red.head_dim
        outs, lses = make_inputs(3, W, 3, H, D, red.dtype, adversarial=False)
        red.reduce(outs[rank].to(red.device), lses[rank].to(red.device))
        red.check()
        dist.barrier(group=red._info.cpu_group)
        T = 2 if rank == 0 else 3
        try:
            red.reduce(outs[rank][:T].contiguous().to(red.device), lses[rank][:T].contiguous().to(red.device))
            red.check()
            res["outcome"] = "no error"
        except PeerTimeoutError as e:
            res["outcome"] = f"PeerTimeoutError mech={e.mechanism}"
    return res


def resources() -> dict:
    pid = os.getpid()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/peerdcp-" in line)
    return {"fds": fds, "maps": maps, "shm": len(glob.glob("/dev/shm/peerdcp-*"))}


def create_close_cycles(config: dict, n: int) -> dict:
    before = resources()
    W, rank = dist.get_world_size(), dist.get_rank()
    for _ in range(n):
        with peerdcp.OutputReducer(None, **config) as red:
            outs, lses = make_inputs(3, W, 1, red.heads, red.head_dim, red.dtype, adversarial=False)
            red.reduce(outs[rank].to(red.device), lses[rank].to(red.device))
    return {"before": before, "after": resources()}


# --------------------------------------------------------------------------------------------- GPU
def gpu_inputs(seed: int, W: int, T: int, H: int, D: int, dtype: torch.dtype, adversarial: bool = True):
    """``make_inputs`` moved to this rank's GPU (all ranks' tensors, so references can be computed here)."""
    outs, lses = make_inputs(seed, W, T, H, D, dtype, adversarial)
    dev = torch.device("cuda", torch.cuda.current_device())
    return [o.to(dev) for o in outs], [l.to(dev) for l in lses]


def graph_replays(
    config: dict, replays: int, t_big: int, t_small: int, n_sets: int = 5, t_mid: int | None = None
) -> dict:
    """Capture back-to-back reduce calls (T = t_big, then t_mid if given, then t_small with return_lse) in
    one CUDA graph; replay it ``replays`` times, copying a new input set into the static inputs before each
    replay (no barrier, no host sync). Every replay is checked on the GPU against the fp64 value's
    fp32-model bounds (``dcp_reduce_bounds``); returns counts."""
    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    with peerdcp.OutputReducer(None, **dict(config, device=dev)) as red:  # the baselines' config names "cuda"
        H, D, dt, base = red.heads, red.head_dim, red.dtype, red.lse_base
        sets = []
        for k in range(n_sets):
            ob, lb = gpu_inputs(100 + k, W, t_big, H, D, dt)
            os_, ls_ = gpu_inputs(200 + k, W, t_small, H, D, dt)
            rb = dcp_reduce_bounds(ob, lb, rank, lse_base=base, out_dtype=dt)
            rs = dcp_reduce_bounds(os_, ls_, rank, lse_base=base, out_dtype=dt)
            om, lm = gpu_inputs(300 + k, W, t_mid or 1, H, D, dt)
            rm = dcp_reduce_bounds(om, lm, rank, lse_base=base, out_dtype=dt)
            sets.append((ob[rank], lb[rank], rb, os_[rank], ls_[rank], rs, om[rank], lm[rank], rm))
        s_ob, s_lb = sets[0][0].clone(), sets[0][1].clone()
        s_os, s_ls = sets[0][3].clone(), sets[0][4].clone()
        s_om, s_lm = sets[0][6].clone(), sets[0][7].clone()
        for _ in range(3):  # warm-up (JIT, allocator) on both ranks equally
            red.reduce(s_ob, s_lb)
            if t_mid:
                red.reduce(s_om, s_lm)
            red.reduce(s_os, s_ls, return_lse=True)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            g_out_b = red.reduce(s_ob, s_lb)
            g_out_m = red.reduce(s_om, s_lm) if t_mid else None
            g_out_s, g_lse_s = red.reduce(s_os, s_ls, return_lse=True)
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        for i in range(replays):
            ob, lb, rb, os_, ls_, rs, om, lm, rm = sets[i % n_sets]
            s_ob.copy_(ob)
            s_lb.copy_(lb)
            s_os.copy_(os_)
            s_ls.copy_(ls_)
            s_om.copy_(om)
            s_lm.copy_(lm)
            g.replay()
            checks = [(g_out_b, rb[:2]), (g_out_s, rs[:2]), (g_lse_s, rs[2:])] + ([(g_out_m, rm[:2])] if t_mid else [])
            replay_bad = torch.zeros((), dtype=torch.bool, device=dev)
            for got, (lo, hi) in checks:  # device reductions: no host sync
                replay_bad |= outside_bounds(got, lo, hi).any()
            bad += replay_bad.to(torch.int64)
        torch.cuda.synchronize()
        red.check()
        info = {"backend": red.backend, "memory": red.memory, "kernel": red.kernel, "programs": red.programs}
    return dict(info, replays=replays, mismatches=int(bad))


def cuda_triton_twins(memory: str, cases: list[int], seed: int) -> list[dict]:
    """The CUDA kernel and its Triton twin on the same inputs: both against the reference, and each other."""
    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    common = dict(max_tokens=max(cases), heads_per_rank=16, head_dim=512, backend="direct", memory=memory, device=dev)
    res = []
    with (
        peerdcp.OutputReducer(None, kernel="cuda", **common) as rc,
        peerdcp.OutputReducer(None, kernel="triton", **common) as rt,
    ):
        for i, T in enumerate(cases):
            outs, lses = gpu_inputs(seed + i, W, T, 16, 512, torch.bfloat16)
            oc, lc = rc.reduce(outs[rank], lses[rank], return_lse=True)
            ot, lt = rt.reduce(outs[rank], lses[rank], return_lse=True)
            ref = dcp_reduce(outs, lses, rank)
            bounds = dcp_reduce_bounds(outs, lses, rank)
            r = check_result(oc, lc, bounds, ref)
            r2 = check_result(ot, lt, bounds, ref)
            same = int((oc != ot).sum())  # same math, same rounding: expect (nearly) identical bits
            res.append({"T": T, "cuda_ok": r["ok"], "triton_ok": r2["ok"], "differ": same, "numel": oc.numel()})
        rc.check()
        rt.check()
        res.append({"kernels": (rc.kernel, rt.kernel), "programs": (rc.programs, rt.programs)})
    return res


def policy_with(spec) -> OutputPolicy | None:
    """A test variant's policy: None (the library default), a tuple (its ``cuda_opts``) or a dict of fields, on
    :data:`~peerdcp.output.policy.DEFAULT_POLICY` (unchecked: the constructor reports bad values)."""
    if spec is None:
        return None
    return dataclasses.replace(DEFAULT_POLICY, **(dict(spec) if isinstance(spec, dict) else {"cuda_opts": spec}))


def construct(config: dict) -> dict:
    """Construct (``config`` = constructor kwargs, a ``policy`` among them): the error ('Type: message') or the
    attributes."""
    try:
        with peerdcp.OutputReducer(None, **config) as red:
            return {"kernel": red.kernel, "cuda_opts": red.cuda_opts, "reason": red.reason}
    except (TypeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def breakdown_then_full(config: dict, T: int, seed: int) -> dict:
    """GPU: every stage-breakdown mask for a few calls (outputs ignored), then full calls again: they must
    be right and no wait may have timed out (the masks keep the ranks' protocol state consistent). The
    instrumented build with nothing left out must be right too."""
    from peerdcp.output import ops

    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    res = {}
    with peerdcp.OutputReducer(None, device=dev, **config) as red:
        H, D, dt = red.heads, red.head_dim, red.dtype
        outs, lses = gpu_inputs(seed, W, T, H, D, dt)
        bounds = dcp_reduce_bounds(outs, lses, rank, lse_base=red.lse_base, out_dtype=dt)
        for name, mask in [*ops.STAGES.items(), ("epoch-only", 15), ("full", 0)]:
            ops._set_breakdown_stages(red, mask)
            for _ in range(5):
                got = red.reduce(outs[rank], lses[rank])
            torch.cuda.synchronize()
            dist.barrier()
            if mask in (0, ops.STAGE_INSTRUMENTED):
                res[name] = not bool(outside_bounds(got, *bounds[:2]).any())
        ops._set_breakdown_stages(red, 0)
        red.check()
        got = red.reduce(outs[rank], lses[rank])
        res["after"] = not bool(outside_bounds(got, *bounds[:2]).any())
        red.check()
    return res


def auto_when_allocation_fails(config: dict, full_rank: int, cases: list[dict], seed: int) -> list[dict]:
    """``backend="auto"`` where the probe passes but the allocation fails (ENOSPC injected into rank
    ``full_rank``'s /dev/shm reservation): every rank falls back to a2a, and the calls still match the reference."""
    import errno
    from unittest import mock

    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if dist.get_rank() != full_rank:
        return run_cases(config, cases, seed)
    with mock.patch("os.posix_fallocate", no_space):
        return run_cases(config, cases, seed)


def a2a_combine_past_2_31() -> dict:
    """See tests/test_output.py::test_a2a_combine_offsets_past_2_31."""
    import triton

    from peerdcp.output import kernels as K

    W, H, D, T = 3, 1, 1024, (1 << 20) - 1
    pb = H * D * 2
    rb = -(-(pb + 4 * H) // 16) * 16
    recv = torch.empty((W, T, rb), dtype=torch.uint8)  # as OutputReducer._a2a lays it out
    rp = recv[:, :, :pb].view(torch.bfloat16).unflatten(-1, (H, D))[:, :1]  # token 0, with the full strides
    rl = recv[:, :, pb : pb + 4 * H].view(torch.float32)[:, :1]
    gen = torch.Generator().manual_seed(5)
    for i in range(W):
        rp[i, 0].copy_(torch.randn(H, D, generator=gen).to(torch.bfloat16))
        rl[i, 0].copy_(torch.randn(H, generator=gen))
    out = torch.full((1, H, D), float("nan"), dtype=torch.bfloat16)
    out_lse = torch.full((1, H), float("nan"), dtype=torch.float32)
    hb = K.heads_per_unit(H, D, 32)
    K.combine_kernel[(1, triton.cdiv(H, hb))](
        rp, rl, out, out_lse, *rp.stride()[:3], *rl.stride()[:3],
        N=W, H=H, D=D, HB=hb, BLOCK_D=triton.next_power_of_2(D), BASE2=False, RETURN_LSE=True, GPU=False,
    )  # fmt: skip
    ref = combine(rp[:, 0].double(), rl[:, 0].double())
    lo, hi, lse_lo, lse_hi = combine_bounds(rp[:, 0], rl[:, 0])
    ok = not bool(outside_bounds(out[0], lo, hi).any() or outside_bounds(out_lse[0], lse_lo, lse_hi).any())
    return {"strides": 2 * rp.stride(0) >= 2**31 > rp.stride(0), "ok": ok, "got": out[0, 0, :3].tolist(),
            "ref": ref[0, :3].tolist()}  # fmt: skip
