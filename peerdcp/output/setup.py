"""The direct backend's set-up for one :class:`~peerdcp.output.OutputReducer` (collective): which kernel (CUDA or
the Triton twin, agreed by every rank), its grid, the protocols by T, the inbox in peer memory, the launcher."""

from __future__ import annotations

import torch

from .._runtime.device import ErrorWord, num_sms, on_gpu, spin_budget
from .._runtime.groups import agree, agree_or_release, all_gather_object
from ..memory import allocate
from . import kernels as K
from .config import Agreed
from .policy import OutputPolicy, sentinel_split_tokens, triton_unit_elems

__all__ = ["setup_direct"]


def _local_kernel(red, kernel: str, a: Agreed, policy: OutputPolicy) -> tuple[str, int | None, int | None, int, int]:
    """This rank's choice before agreement: (kernel, co-resident CTA limit, heads per unit, SMs, CUDA variant bits
    (ops.OPTS)). A configuration error raises ValueError (the same on every rank: the arguments are agreed)."""
    dev, W = red.device, red.world_size
    choice, limit, hpu, sms = "triton", None, None, 1
    mask = 0
    if on_gpu(dev):
        sms = num_sms(dev.index)
        want = policy.direct_kernel if kernel == "auto" else kernel
        cuda_ok = red.head_dim % 8 == 0 and W <= 8 and red.max_tokens * W * red.heads * red.head_dim < 2**34
        if want == "cuda" and not cuda_ok:
            if kernel == "cuda":
                raise ValueError(
                    "kernel='cuda' needs head_dim % 8 == 0, world size <= 8 and "
                    "max_tokens*W*H*D < 2**34; use kernel='triton'"
                )
            want = "triton"
        if want == "cuda":
            from . import ops

            try:
                with torch.cuda.device(dev):
                    mask = ops.opts_mask(c for c in a.cuda_opts if c != "sentinel" or a.sentinel)
                    mask |= ops.OPTS["ll128"] if a.ll128_max_tokens else 0
                    per_sm = ops.blocks_per_sm(W, red.dtype, dev.index, opts=mask)
                    block = ops.cuda_block()
                if per_sm < 1:
                    raise RuntimeError("the CUDA kernel cannot be resident on this device")
                limit = per_sm * sms
                choice = "cuda"
                hpu = max(1, min(red.heads, block // (red.head_dim // 8)))
            except Exception as e:  # noqa: BLE001 - a failed build falls back on every rank (setup_direct)
                if kernel == "cuda":
                    raise
                red.reason += f"; CUDA kernel unavailable ({type(e).__name__}: {e}), Triton kernel used"
        if choice == "triton":
            limit = sms  # one 4-warp program per SM always fits
    elif kernel == "cuda":
        raise ValueError("kernel='cuda' needs CUDA tensors; CPU uses the Triton kernel (interpreter)")
    return choice, limit, hpu, sms, mask


def setup_direct(red, kernel: str, programs: int | None, a: Agreed, policy: OutputPolicy) -> None:
    """Choose and agree the kernel and grid, set ``red``'s direct-path attributes (``kernel``, ``programs``, the
    protocol ranges, ``reason``), allocate the inbox and build the launcher. Raises on every rank alike."""
    info, dev, W = red._info, red.device, red.world_size
    gpu = on_gpu(dev)
    err: BaseException | None = None
    choice, limit, hpu, sms, mask = "triton", None, None, 1, 0
    try:
        choice, limit, hpu, sms, mask = _local_kernel(red, kernel, a, policy)
    except BaseException as e:  # noqa: BLE001
        err = e
    if isinstance(err, ValueError):  # a configuration error: the same on every rank (arguments agreed)
        raise err
    agree(info, err, "OutputReducer kernel selection")
    choices = all_gather_object(info, (choice, limit))
    if len({c for c, _ in choices}) != 1:  # one rank could not build the CUDA kernel: all use Triton
        choice, hpu = "triton", None
        limits = [sms for _ in choices]
        red.reason += "; ranks differ in CUDA kernel availability, Triton kernel used on all"
    else:
        limits = [lim for _, lim in choices]
    if gpu:
        per_sm = policy.cuda_programs_per_sm if choice == "cuda" else policy.triton_programs_per_sm
        G = min(min(x for x in limits if x), per_sm * sms)
        G = min(G, min(all_gather_object(info, G)))
        if programs is not None:
            if programs > G:
                agree(info, f"programs={programs} exceeds the co-resident limit {G} on this device", "programs")
            G = programs
    else:
        G = programs if programs is not None else policy.interpreter_programs
    red.kernel, red.programs = choice, G
    cuda = choice == "cuda"
    red._hpu = hpu if cuda else K.heads_per_unit(red.heads, red.head_dim, triton_unit_elems(policy, gpu))
    red.ll_max_tokens = min(a.ll_max_tokens, red.max_tokens) if cuda else 0
    red.cuda_opts = a.cuda_opts if cuda else ()
    red.ll128_max_tokens = a.ll128_max_tokens if cuda else 0
    red._ll128_min = a.ll128_min_tokens if red.ll128_max_tokens else 0
    red._opts_mask = mask if cuda else 0
    # sentinel kernel: calls with T > sn_min; split roles by the table (publishers >= G: every CTA both)
    red._sn = cuda and a.sentinel is not None
    red._sn_min, sn_split = a.sentinel if red._sn else (0, ())
    elem = torch.empty((), dtype=red.dtype).element_size()  # bytes per element: split table and layout
    red._sn_split = sentinel_split_tokens(sn_split, red.heads * red.head_dim * elem, G)
    red.reason += _reason(red)

    red._layout = K.InboxLayout(
        W, G, red.max_tokens, red.heads, red.head_dim, elem, red.ll_max_tokens,
        ll128_tokens=red.ll128_max_tokens, sn_tokens=red.max_tokens if red._sn else 0,
    )  # fmt: skip
    red._buf = allocate(red._layout.nbytes, info.group, memory=red.memory, device=dev)
    if red._sn:  # the sentinel region's rest state (every byte 0xFF), before any peer can publish into it
        red._buf.fill_collective(red._layout.sn_off, red._layout.sn_payload_bytes, 0xFF)
    local_err = None
    try:
        red._epochs = torch.zeros(G, dtype=torch.int64, device=dev)
        red._err = ErrorWord(dev, red.timeout_s)
        red._timeout_ns = int(red.timeout_s * 1e9)
        red._max_spins = spin_budget(red.timeout_s, dev)
        red._gpu = gpu
        red._dummy_lse = torch.empty(1, dtype=torch.float32, device=dev)
        if cuda:
            red._launch_cuda = _cuda_launcher(red)
    except Exception as e:  # noqa: BLE001 - (out of device / pinned memory on this rank: agreed below)
        local_err = e
    agree_or_release(info, local_err, "OutputReducer set-up after the allocation", red._buf)


def _reason(red) -> str:
    """The kernel, grid and protocol ranges, for ``red.reason``."""
    s = f"; {red.kernel} kernel, {red.programs} programs" + (
        f", LL protocol for T <= {red.ll_max_tokens}" if red.ll_max_tokens else ""
    )
    if red.ll128_max_tokens:
        lo = max(red.ll_max_tokens, red._ll128_min)
        s += f", LL128 for {lo} < T <= {red.ll128_max_tokens}"
    if red._sn:
        lo = max(red._sn_min, red.ll_max_tokens)
        s += f", sentinel kernel for T > {lo}"
        if red._sn_split:
            s += " (publisher CTAs " + ", ".join(f"{n} x {u} loads for T > {t}" for t, n, u in red._sn_split) + ")"
    if red.cuda_opts:
        s += f", kernel variants {'+'.join(red.cuda_opts)}"
    return s


def _cuda_launcher(red):
    """The reducer's :class:`~peerdcp.output.ops.DirectLauncher` (its constant fields filled once)."""
    from .ops import DirectLauncher

    L = red._layout
    return DirectLauncher(
        peer_addrs=red._buf.peer_addrs,
        epochs=red._epochs,
        err_addr=red._err.kernel_arg(),
        rank=red.rank,
        heads=red.heads,
        head_dim=red.head_dim,
        max_tokens=red.max_tokens,
        programs=red.programs,
        heads_per_unit=red._hpu,
        lse_off=L.lse_off,
        payload_off=L.payload_off,
        timeout_ns=red._timeout_ns,
        base2=red._base2,
        dtype=red.dtype,
        mech=red._mech,
        device=red.device.index,
        ll_off=L.ll_off,
        ll_max_tokens=red.ll_max_tokens,
        opts=red._opts_mask,
        ll128_off=L.ll128_off,
        ll128_max_tokens=red.ll128_max_tokens,
        ll128_min_tokens=red._ll128_min,
        sn_off=L.sn_off,
        sn_lse_off=L.sn_lse_off,
        sn_min_tokens=red._sn_min,
        sn_split=red._sn_split,
    )
