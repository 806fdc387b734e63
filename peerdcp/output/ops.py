"""The CUDA fast path of the direct exchange: ``csrc/output/direct.cu`` behind a C ABI and a torch.library op.

``peerdcp::output_direct`` is a real custom op (``torch.library.custom_op`` with a fake implementation,
so ``torch.compile`` can trace through it); it launches the fused kernel on the current CUDA stream
and is therefore CUDA-graph capturable. Eager calls from :class:`~peerdcp.output.OutputReducer` use
:class:`DirectLauncher`, which keeps a prebuilt parameter block and skips the dispatcher (a few µs of
Python per call); under ``torch.compile`` the reducer calls the op.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .._runtime.device import current_stream_handle, num_sms
from .._runtime.jit import check_param_block
from .._runtime.jit import load as load_jit

__all__ = ["OutputDirectParams", "library", "blocks_per_sm", "cuda_block", "DirectLauncher", "output_direct", "OPTS"]

MAX_WORLD = 8
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}

# Opt-in kernel variants (``opts`` bits of the parameter block; see csrc/output/direct.cu). The default is
# none of them; a reducer picks them from its policy's cuda_opts at construction (agreed by every rank).
OPTS = {"tight_grid": 1, "early_load": 2, "pdl": 4, "ll128": 8, "chunked": 16, "split_roles": 32, "sentinel": 64}

# Stage-breakdown bits (``stages``; benchmark only, never set by a public path; outputs are garbage).
STAGE_SKIP_PAYLOAD = 1
STAGE_SKIP_LSE = 2
STAGE_SKIP_SYNC = 4
STAGE_SKIP_COMBINE = 8
STAGE_EMPTY = 16
STAGE_INSTRUMENTED = 32
STAGES = {
    "instrumented": STAGE_INSTRUMENTED,  # nothing skipped, the instrumented build (its cost vs the default)
    "-payload": STAGE_SKIP_PAYLOAD,
    "-lse": STAGE_SKIP_LSE,
    "-sync": STAGE_SKIP_SYNC,
    "-combine": STAGE_SKIP_COMBINE,
    "empty": STAGE_EMPTY,
}
_STAGES_ALL = 63


def opts_mask(names) -> int:
    """``opts`` bits of the variant names (a subset of :data:`OPTS`); ValueError names an unknown one."""
    mask = 0
    for n in names:
        if n not in OPTS:
            raise ValueError(f"unknown CUDA kernel option {n!r}; expected a subset of {tuple(OPTS)}")
        mask |= OPTS[n]
    return mask


class OutputDirectParams(ctypes.Structure):
    """Mirror of ``OutputDirectParams`` in ``csrc/output/direct.cu`` (same order, same types)."""

    _fields_ = [
        ("partial_out", ctypes.c_void_p),
        ("partial_lse", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_lse", ctypes.c_void_p),
        ("epochs", ctypes.c_void_p),
        ("err", ctypes.c_void_p),
        ("peer_base", ctypes.c_void_p * MAX_WORLD),
        ("lse_off", ctypes.c_int64),
        ("payload_off", ctypes.c_int64),
        ("timeout_ns", ctypes.c_int64),
        ("ll_off", ctypes.c_int64),
        ("ll128_off", ctypes.c_int64),
        ("T", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("W", ctypes.c_int32),
        ("H", ctypes.c_int32),
        ("D", ctypes.c_int32),
        ("max_tokens", ctypes.c_int32),
        ("G", ctypes.c_int32),
        ("heads_per_unit", ctypes.c_int32),
        ("base2", ctypes.c_int32),
        ("mech", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("ll_max_tokens", ctypes.c_int32),
        ("stages", ctypes.c_int32),
        ("opts", ctypes.c_int32),
        ("ll128_max_tokens", ctypes.c_int32),
        ("sn_pub", ctypes.c_int32),
        ("sn_loads", ctypes.c_int32),
        ("sn_off", ctypes.c_int64),
        ("sn_lse_off", ctypes.c_int64),
        # diagnosis only (scripts/diag/sentinel_timeline.py, in git history); None everywhere else
        ("dbg", ctypes.c_void_p),
    ]


@functools.cache
def library() -> ctypes.CDLL:
    """Build (first use, cached on disk) and load ``libpeerdcp_output.so``; checks the parameter layout."""
    lib = load_jit("peerdcp_output")
    lib.peerdcp_output_direct.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.peerdcp_output_direct.restype = ctypes.c_int
    lib.peerdcp_output_direct_blocks_per_sm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.peerdcp_output_direct_blocks_per_sm.restype = ctypes.c_int
    lib.peerdcp_output_direct_blocks_per_sm_variant.argtypes = [ctypes.c_int] * 5
    lib.peerdcp_output_direct_blocks_per_sm_variant.restype = ctypes.c_int
    check_param_block(lib, "peerdcp_output_direct_params_size", OutputDirectParams)
    return lib


def cuda_block() -> int:
    return int(library().peerdcp_output_direct_block())


def blocks_per_sm(world_size: int, dtype: torch.dtype, device: int, *, stages: int = 0, opts: int = 0) -> int:
    """Co-resident CTAs of the kernel per SM on ``device`` (for the deadlock-free grid bound); 0 on error.
    With ``stages`` / ``opts``: the minimum of the default build and the instantiation those select."""
    if stages == 0 and opts == 0:
        return int(library().peerdcp_output_direct_blocks_per_sm(world_size, _DTYPE_CODE[dtype], device))
    return int(
        library().peerdcp_output_direct_blocks_per_sm_variant(world_size, _DTYPE_CODE[dtype], device, stages, opts)
    )


def _check(err: int) -> None:
    if err != 0:
        raise RuntimeError(f"peerdcp_output_direct launch failed with cudaError {err}")


class DirectLauncher:
    """Launches the fused CUDA kernel for one reducer: the constant fields are filled once."""

    def __init__(
        self,
        *,
        peer_addrs: list[int],
        epochs: torch.Tensor,
        err_addr: int,
        rank: int,
        heads: int,
        head_dim: int,
        max_tokens: int,
        programs: int,
        heads_per_unit: int,
        lse_off: int,
        payload_off: int,
        timeout_ns: int,
        base2: bool,
        dtype: torch.dtype,
        mech: int,
        device: int,
        ll_off: int = 0,
        ll_max_tokens: int = 0,
        opts: int = 0,
        ll128_off: int = 0,
        ll128_max_tokens: int = 0,
        ll128_min_tokens: int = 0,
        sn_off: int = 0,
        sn_lse_off: int = 0,
        sn_min_tokens: int = 0,
        sn_split: tuple = (),
    ) -> None:
        self._lib = library()
        # Per-call bits, decided from T alone (the same on every rank): calls with T <= ll128_min_tokens run
        # without the LL128 bit (the LL128 band is (max(ll_max_tokens, ll128_min_tokens), ll128_max_tokens]),
        # calls with T <= sn_min_tokens without the sentinel bit; sentinel calls split the CTAs into n publishers
        # and combiners (sn_pub = n) with u loads in flight per publishing thread (sn_loads) for the last (t, n, u)
        # of sn_split with T > t, else every CTA does both (0) with 2 loads in flight.
        self._opts = opts
        self._ll128_min, self._sn_min = ll128_min_tokens, sn_min_tokens
        self._sn_split = tuple((int(t), int(n), int(u)) for t, n, u in sn_split)
        self._device = ctypes.c_int(device)
        p = OutputDirectParams()
        for i, a in enumerate(peer_addrs):
            p.peer_base[i] = a
        p.epochs = epochs.data_ptr()
        p.err = err_addr
        p.lse_off, p.payload_off, p.timeout_ns, p.ll_off = lse_off, payload_off, timeout_ns, ll_off
        p.ll128_off = ll128_off
        p.ll_max_tokens = ll_max_tokens
        p.ll128_max_tokens = ll128_max_tokens
        p.sn_off, p.sn_lse_off = sn_off, sn_lse_off
        p.rank, p.W, p.H, p.D = rank, len(peer_addrs), heads, head_dim
        p.max_tokens, p.G, p.heads_per_unit = max_tokens, programs, heads_per_unit
        p.base2, p.mech, p.dtype = int(base2), mech, _DTYPE_CODE[dtype]
        p.opts = opts
        p.stages = 0  # only _set_stages (benchmark) changes it
        self._p = p
        self._pp = ctypes.byref(p)
        self._epochs = epochs  # keep alive

    def __call__(
        self, partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor | None
    ) -> None:
        self._fill(partial_out, partial_lse, out, out_lse)
        stream = ctypes.c_void_p(current_stream_handle(partial_out.device))
        _check(self._lib.peerdcp_output_direct(self._pp, stream, self._device))

    def _fill(
        self, partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor | None
    ) -> None:
        """The call's fields of the parameter block (pointers, T, and the per-T option bits), without a launch:
        tests check the T-dependent choices here (a launch with their fake peer addresses would fault a GPU)."""
        p = self._p
        p.partial_out = partial_out.data_ptr()
        p.partial_lse = partial_lse.data_ptr()
        p.out = out.data_ptr()
        p.out_lse = out_lse.data_ptr() if out_lse is not None else None
        tokens = p.T = partial_out.shape[0]
        opts = self._opts
        if tokens <= self._ll128_min:
            opts &= ~OPTS["ll128"]
        if tokens <= self._sn_min:
            opts &= ~OPTS["sentinel"]
        p.opts = opts
        pub, loads = 0, 2
        for t, n, u in self._sn_split:
            if tokens > t:
                pub, loads = n, u
        p.sn_pub, p.sn_loads = pub, loads

    @property
    def stages(self) -> int:
        return int(self._p.stages)

    def _set_stages(self, stages: int) -> None:
        """Benchmark only (see :func:`_set_breakdown_stages`): later launches (and captures) use ``stages``."""
        if isinstance(stages, bool) or not isinstance(stages, int) or stages & ~_STAGES_ALL:
            raise ValueError(f"stages must be an int mask of the STAGE_* bits (0..{_STAGES_ALL}), got {stages!r}")
        if stages and self._opts & (
            OPTS["early_load"] | OPTS["pdl"] | OPTS["ll128"] | OPTS["chunked"] | OPTS["sentinel"]
        ):
            raise ValueError(
                "the stage breakdown runs the default kernel: not with opts early_load/pdl/ll128/chunked/sentinel"
            )
        self._p.stages = stages


def _set_breakdown_stages(reducer, stages: int) -> int:
    """BENCHMARK ONLY: make ``reducer``'s later CUDA launches skip the stages in ``stages`` (STAGE_* bits;
    0 restores the full kernel); returns the previous mask. Outputs are wrong while it is nonzero, and every
    rank must set the same mask before the same calls (a rank that waits for a stage its peer skipped would
    time out). Not reachable from the public API: no constructor argument, no policy field, not in __all__;
    CUDA graphs captured meanwhile keep the mask they were captured with."""
    launcher = getattr(reducer, "_launch_cuda", None)
    if getattr(reducer, "kernel", None) != "cuda" or launcher is None:
        raise ValueError("the stage breakdown needs an OutputReducer with backend='direct' and kernel='cuda'")
    prev = launcher.stages
    if stages:
        per_sm = blocks_per_sm(reducer.world_size, reducer.dtype, reducer.device.index, stages=stages)
        sms = num_sms(reducer.device.index)
        if per_sm * sms < reducer.programs:
            raise ValueError(f"the instrumented kernel fits {per_sm} CTAs per SM: fewer than the reducer's grid")
    launcher._set_stages(stages)
    return prev


@torch.library.custom_op("peerdcp::output_direct", mutates_args=("out", "out_lse", "epochs"), device_types="cuda")
def output_direct(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
    epochs: torch.Tensor,
    peer_addrs: list[int],
    err_addr: int,
    rank: int,
    programs: int,
    heads_per_unit: int,
    max_tokens: int,
    lse_off: int,
    payload_off: int,
    timeout_ns: int,
    base2: bool,
    return_lse: bool,
    mech: int,
    ll_off: int,
    ll_max_tokens: int,
    opts: int = 0,
    ll128_off: int = 0,
    ll128_max_tokens: int = 0,
    ll128_min_tokens: int = 0,
    sn_off: int = 0,
    sn_lse_off: int = 0,
    sn_min_tokens: int = 0,
    sn_split: list[int] | None = None,
) -> None:
    """The fused direct exchange + combine (see ``csrc/output/direct.cu``). Writes ``out [T, H, D]`` and,
    with ``return_lse``, ``out_lse [T, H]``; advances ``epochs``. Inputs are validated by the caller.
    ``opts``: the reducer's opt-in kernel variants (:data:`OPTS` bits; 0 = default)."""
    launcher = DirectLauncher(
        peer_addrs=list(peer_addrs),
        epochs=epochs,
        err_addr=err_addr,
        rank=rank,
        heads=out.shape[1],
        head_dim=out.shape[2],
        max_tokens=max_tokens,
        programs=programs,
        heads_per_unit=heads_per_unit,
        lse_off=lse_off,
        payload_off=payload_off,
        timeout_ns=timeout_ns,
        base2=base2,
        dtype=out.dtype,
        mech=mech,
        device=out.device.index,
        ll_off=ll_off,
        ll_max_tokens=ll_max_tokens,
        opts=opts,
        ll128_off=ll128_off,
        ll128_max_tokens=ll128_max_tokens,
        ll128_min_tokens=ll128_min_tokens,
        sn_off=sn_off,
        sn_lse_off=sn_lse_off,
        sn_min_tokens=sn_min_tokens,
        sn_split=tuple(zip(sn_split[::3], sn_split[1::3], sn_split[2::3])) if sn_split else (),
    )
    launcher(partial_out, partial_lse, out, out_lse if return_lse else None)


@output_direct.register_fake
def _output_direct_fake(
    partial_out, partial_lse, out, out_lse, epochs, peer_addrs, err_addr, rank, programs, heads_per_unit,
    max_tokens, lse_off, payload_off, timeout_ns, base2, return_lse, mech, ll_off, ll_max_tokens, opts=0,
    ll128_off=0, ll128_max_tokens=0, ll128_min_tokens=0, sn_off=0, sn_lse_off=0, sn_min_tokens=0, sn_split=None,
) -> None:  # fmt: skip
    return None
