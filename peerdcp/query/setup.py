"""Set-up of a QueryGather (collective, at construction): the kernel choice, and the direct backend's grid,
exposed buffer, state and CUDA launcher. Functions of the object under construction (``qg``), called by its
``__init__`` only."""

from __future__ import annotations

import torch

from .. import memory as _memory
from .._runtime.device import ErrorWord, mechanism_code, num_sms, spin_budget
from .._runtime.groups import agree, agree_or_release, all_gather_object
from . import kernels as K
from .layout import direct_layout
from .policy import sn_programs_per_sm

__all__ = ["choose_impl", "setup_direct", "cuda_launcher"]


def choose_impl(qg, impl: str, reasons: list[str]) -> str:
    """The kernel (``qg.impl``) for ``impl``: on the direct backend the CUDA kernel only where every rank built it."""
    info = qg._info
    if qg.backend == "allgather":
        chosen = "triton" if impl == "auto" else impl
        what = " (one fused Triton RoPE + convert kernel)" if chosen == "triton" else " (plain torch ops)"
        reasons.append(f"impl {chosen}{what}")
        return chosen
    want = impl
    if impl == "auto":
        want = qg.policy.gpu_impl if qg._gpu else "triton"
    if want == "cuda" and (qg.nope_dim % 16 or qg.world_size > 8):
        why = f"nope_dim {qg.nope_dim} is not a multiple of 16 or W = {qg.world_size} > 8"
        if impl == "cuda":
            raise ValueError(f"impl='cuda' needs nope_dim % 16 == 0 and W <= 8: {why}")
        reasons.append(f"impl triton (the CUDA kernel does not cover this geometry: {why})")
        return "triton"
    err = None
    if want == "cuda":
        try:
            from . import ops

            ops.load()
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = f"{type(e).__name__}: {e}"
    errs = all_gather_object(info, err)
    failed = [(r, m) for r, m in enumerate(errs) if m is not None]
    if failed and impl == "cuda":
        agree(info, err, "QueryGather CUDA kernel build")
    if failed:
        reasons.append(f"impl triton (the CUDA kernel is unavailable on rank {failed[0][0]}: {failed[0][1]})")
        return "triton"
    reasons.append(f"impl {want}" + (" (default)" if impl == "auto" else ""))
    return want


def setup_direct(qg, num_programs: int | None, reasons: list[str]) -> None:
    """The grid (agreed: the minimum over the ranks), the exposed buffer and the call state of the direct backend."""
    info, dev, W, H = qg._info, qg.device, qg.world_size, qg.heads_per_rank
    plan, policy = qg._plan, qg.policy
    if dev.type == "cuda":  # the SN call grid's floor, whoever sized the object's grid
        sms = num_sms(dev.index)
        qg._sn_floor = int(policy.cuda_sn_min_blocks_per_sm * sms)
    if num_programs is None:
        if dev.type == "cuda":
            per_sm = 2
            if plan.sn_max:  # the sentinel push: more blocks in flight, as many as fit at once
                from . import ops

                fp8 = qg.out_dtype == torch.float8_e4m3fn
                per_sm = sn_programs_per_sm(policy, ops.sn_blocks_per_sm(qg.rope_style == "neox", fp8))
            num_programs = per_sm * sms
        else:
            num_programs = 4
    grids = all_gather_object(info, (num_programs, qg._sn_floor))
    qg.num_programs = NP = min(g[0] for g in grids)  # the grids must match: twin programs wait for each other
    qg._sn_floor = min(g[1] for g in grids)  # (SN areas are unit-indexed; one rule everywhere all the same)
    if plan.sn_max and dev.type == "cuda":
        pdl = ", PDL on every SN call" if plan.sn_pdl else ""
        cut = ""
        if plan.sn_upb > 0:
            cut = f"; an SN call on ceil(T*H/{plan.sn_upb}) of them, at least min(T*H, {qg._sn_floor})"
        reasons.append(f"grid {NP} blocks (sentinel push: up to {policy.cuda_sn_programs_per_sm} per SM{pdl}{cut})")
    qg._bu = 4 if qg._gpu else 2
    qg._layout = lay = direct_layout(
        max_tokens=qg.max_tokens,
        heads=H,
        head_dim=qg.head_dim,
        world=W,
        nprog=NP,
        out_size=qg.out_dtype.itemsize,
        push_slots=plan.push_slots,
        ll_area=plan.ll_area,
        ll128_lines=plan.ll128_lines,
        sn_max=plan.sn_max,
    )
    qg._buf = _memory.allocate(lay.total, info.group, memory=qg.memory, device=dev)
    if lay.sn_bytes:  # its rest state (every byte 0xFF), before any peer can publish into it
        qg._buf.fill_collective(lay.sn_off, lay.sn_bytes, 0xFF)
    local_err = None
    try:
        qg._epochs = torch.zeros(NP, dtype=torch.int64, device=dev)
        qg._last_z = torch.zeros(NP, dtype=torch.int64, device=dev)
        qg._err = ErrorWord(dev, qg.timeout_s)
        qg._timeout_ns = int(qg.timeout_s * 1e9)
        qg._spins = spin_budget(qg.timeout_s, dev)
        qg._mech = mechanism_code("query")
        z = lay.data_off + K.SLOT_Z * lay.slot_bytes
        n_nope = qg.max_tokens * H * qg.nope_dim
        qg._z_nope = qg._buf.view(qg.rank, (qg.max_tokens, H, qg.nope_dim), torch.bfloat16, z)
        qg._z_pe = qg._buf.view(qg.rank, (qg.max_tokens, H, qg.rope_dim), torch.bfloat16, z + 2 * n_nope)
        if qg.impl == "cuda":
            qg._launch_cuda = cuda_launcher(qg)
    except Exception as e:  # noqa: BLE001 - (out of device / pinned memory on this rank: agreed below)
        local_err = e
    agree_or_release(info, local_err, "QueryGather set-up after the allocation", qg._buf)


def cuda_launcher(qg):
    """The CUDA kernel's launcher, with this object's fixed parameters."""
    from . import ops

    lay, plan = qg._layout, qg._plan
    return ops.DirectLauncher(
        peer_addrs=qg._buf.peer_addrs,
        epochs=qg._epochs,
        last_z=qg._last_z,
        quant_scale=qg.quant_scale,
        err=qg._err.kernel_arg(),
        timeout_ns=qg._timeout_ns,
        max_tokens=qg.max_tokens,
        data_off=lay.data_off,
        slot_bytes=lay.slot_bytes,
        ll_off=lay.ll_off,
        ll_max_tokens=plan.ll_area,
        ll128_off=lay.ll128_off,
        ll128_lines=plan.ll128_lines,
        sn_off=lay.sn_off,
        sn_max_tokens=plan.sn_max,
        rank=qg.rank,
        W=qg.world_size,
        H=qg.heads_per_rank,
        HOUT=qg.out_heads,
        NOPE=qg.nope_dim,
        ROPE=qg.rope_dim,
        nprog=qg.num_programs,
        neox=int(qg.rope_style == "neox"),
        fp8=int(qg.out_dtype == torch.float8_e4m3fn),
        mech=qg._mech,
    )
