"""The CUDA C++ direct kernel (``csrc/query/direct.cu``) as ``torch.library`` custom ops.

``peerdcp::query_direct`` and ``peerdcp::query_wait_acks`` launch the C-ABI entry points (built at first
use by :func:`peerdcp._runtime.jit.load`) on the current stream, so they are CUDA-graph capturable. Both
mutate their state tensors in place and return nothing; their fake implementations do nothing (there is
no output to shape). Peer memory, the error word and the remote flags are raw addresses: the ops'
effects on them are invisible to torch by design.

:func:`query_direct` and :func:`query_wait_acks` go through the ops only under ``torch.compile``; eager calls
(and CUDA-graph captures, which record the same launch) call the launch functions directly, as the Output
reducer does: an eager gather takes 127-158 µs of host time through the op and 36-38 µs without it (T = 1,
two H200s, ``scripts/diag/query_eager_profile.py`` (in git history)).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .._runtime.device import current_stream_handle
from .._runtime.jit import load as load_jit

__all__ = ["load", "query_direct", "query_wait_acks", "sn_blocks_per_sm"]


_i64, _i32, _vp, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once per source hash) and load ``libpeerdcp_query.so``; raises JitError without nvcc."""
    lib = load_jit("peerdcp_query")  # flags in peerdcp._runtime.jit.LIBRARIES (no fast math, no FMA contraction)
    lib.peerdcp_query_direct.restype = ctypes.c_int
    lib.peerdcp_query_direct.argtypes = [
        _vp,
        _vp,
        _i64,
        _i64,
        _i64,
        _i64,  # q_nope, q_pe, strides
        _vp,
        _i32,
        _vp,
        _i64,  # pos, pos64, cos_sin, max_pos
        _vp,
        _vp,
        _vp,
        _vp,
        _vp,  # out, peer_addrs (host uint64[W]), epochs, last_z, err
        _i64,
        _f32,  # timeout_ns, quant_scale
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,  # T, rank, W, H, HOUT, NOPE, ROPE
        _i64,
        _i64,
        _i64,  # max_tokens, data_off, slot_bytes
        _i64,
        _i64,  # ll_off, ll_max_tokens
        _i64,
        _i64,  # ll128_off, ll128_lines
        _i64,
        _i64,  # sn_off, sn_max_tokens
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,  # nprog, blocks, mode, neox, fp8, mech
        _vp,  # stream
    ]
    lib.peerdcp_query_sn_blocks_per_sm.restype = ctypes.c_int
    lib.peerdcp_query_sn_blocks_per_sm.argtypes = [_i32, _i32, ctypes.POINTER(_i32)]
    lib.peerdcp_query_wait_acks.restype = ctypes.c_int
    lib.peerdcp_query_wait_acks.argtypes = [_vp, _vp, _vp, _i64, _i32, _i32, _i32, _i32, _vp]
    return lib


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"peerdcp {what} launch failed: CUDA error {err}")


@functools.cache
def _addr_array(addrs: tuple[int, ...]) -> ctypes.Array:
    return (ctypes.c_uint64 * len(addrs))(*addrs)


def _launch_query_direct(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out: torch.Tensor,
    epochs: torch.Tensor,
    last_z: torch.Tensor,
    peer_addrs: list[int],
    err_addr: int,
    timeout_ns: int,
    quant_scale: float,
    geometry: list[int],
) -> None:
    (T, rank, W, H, HOUT, NOPE, ROPE, max_tokens, data_off, slot_bytes, ll_off, ll_max, ll128_off, ll128_lines) = (
        geometry[:14]
    )
    sn_off, sn_max, nprog, blocks, mode, neox, mech = geometry[14:]
    lib = load()
    stream = current_stream_handle(out.device)
    err = lib.peerdcp_query_direct(
        q_nope.data_ptr(),
        q_pe.data_ptr(),
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        positions.data_ptr(),
        int(positions.dtype == torch.int64),
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        out.data_ptr(),
        ctypes.cast(_addr_array(tuple(peer_addrs)), _vp),
        epochs.data_ptr(),
        last_z.data_ptr(),
        err_addr,
        timeout_ns,
        quant_scale,
        T,
        rank,
        W,
        H,
        HOUT,
        NOPE,
        ROPE,
        max_tokens,
        data_off,
        slot_bytes,
        ll_off,
        ll_max,
        ll128_off,
        ll128_lines,
        sn_off,
        sn_max,
        nprog,
        blocks,
        mode,
        neox,
        int(out.dtype == torch.float8_e4m3fn),
        mech,
        stream,
    )
    _check(err, "query_direct")


_query_direct_op = torch.library.custom_op("peerdcp::query_direct", mutates_args=("out", "epochs", "last_z"))(
    _launch_query_direct
)


@_query_direct_op.register_fake
def _(
    q_nope, q_pe, positions, cos_sin_cache, out, epochs, last_z, peer_addrs, err_addr, timeout_ns, quant_scale, geometry
) -> None:
    return None


def _launch_query_wait_acks(
    last_z: torch.Tensor, peer_addrs: list[int], err_addr: int, timeout_ns: int, geometry: list[int]
) -> None:
    rank, W, nprog, mech = geometry
    stream = current_stream_handle(last_z.device)
    err = load().peerdcp_query_wait_acks(
        ctypes.cast(_addr_array(tuple(peer_addrs)), _vp),
        last_z.data_ptr(),
        err_addr,
        timeout_ns,
        rank,
        W,
        nprog,
        mech,
        stream,
    )
    _check(err, "query_wait_acks")


_query_wait_acks_op = torch.library.custom_op("peerdcp::query_wait_acks", mutates_args=("last_z",))(
    _launch_query_wait_acks
)


@_query_wait_acks_op.register_fake
def _(last_z, peer_addrs, err_addr, timeout_ns, geometry) -> None:
    return None


def query_direct(
    q_nope,
    q_pe,
    positions,
    cos_sin_cache,
    out,
    peer_addrs,
    epochs,
    last_z,
    err_addr,
    timeout_ns,
    quant_scale,
    T,
    rank,
    W,
    H,
    HOUT,
    NOPE,
    ROPE,
    max_tokens,
    data_off,
    slot_bytes,
    ll_off,
    ll_max_tokens,
    ll128_off,
    ll128_lines,
    sn_off,
    sn_max_tokens,
    nprog,
    mode,
    neox,
    mech,
    blocks: int = 0,
) -> None:
    """Launch one call of the CUDA direct kernel on the current stream (see ``csrc/query/direct.cu``).

    ``nprog`` is the object's grid (its call counters); ``blocks`` this launch's grid (0: ``nprog``), fewer only
    for the flag-free push modes (LL, LL12, LL128, SN)."""
    launch = torch.ops.peerdcp.query_direct if torch.compiler.is_compiling() else _launch_query_direct
    launch(
        q_nope,
        q_pe,
        positions,
        cos_sin_cache,
        out,
        epochs,
        last_z,
        list(peer_addrs),
        err_addr,
        timeout_ns,
        quant_scale,
        [T, rank, W, H, HOUT, NOPE, ROPE, max_tokens, data_off, slot_bytes, ll_off, ll_max_tokens, ll128_off]
        + [ll128_lines, sn_off, sn_max_tokens, nprog, blocks, mode, int(neox), mech],
    )


def query_wait_acks(peer_addrs, last_z, err_addr, timeout_ns, rank, W, nprog, mech) -> None:
    """Launch the zero-copy ack wait (``exposed_shard``) on the current stream."""
    launch = torch.ops.peerdcp.query_wait_acks if torch.compiler.is_compiling() else _launch_query_wait_acks
    launch(last_z, list(peer_addrs), err_addr, timeout_ns, [rank, W, nprog, mech])


def sn_blocks_per_sm(neox: bool, fp8: bool) -> int:
    """Blocks of the sentinel-push kernels (interleaved FP8: the 8- and 16-byte ones) resident on one SM at once,
    on the current device (``cudaOccupancyMaxActiveBlocksPerMultiprocessor``: registers, shared memory, 256
    threads a block)."""
    n = _i32(0)
    _check(load().peerdcp_query_sn_blocks_per_sm(int(neox), int(fp8), ctypes.byref(n)), "sn_blocks_per_sm")
    return int(n.value)
