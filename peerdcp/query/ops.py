"""The CUDA C++ direct kernel (``csrc/query/direct.cu``) behind a C ABI and ``torch.library`` custom ops.

Both launch entry points take one parameter block, :class:`QueryDirectParams` (mirrored field by field in
``csrc/query/direct.cu``), and its size: the C side refuses a block of another size, and :func:`load` checks the
two sizes agree. ``peerdcp::query_direct`` and ``peerdcp::query_wait_acks`` are custom ops with fake
implementations (so ``torch.compile`` traces through them); they launch on the current stream, so they are
CUDA-graph capturable. Both mutate their state tensors in place and return nothing. Peer memory, the error word
and the remote flags are raw addresses: the ops' effects on them are invisible to torch by design.

Eager calls (and CUDA-graph captures, which record the same launch) go through :class:`DirectLauncher`, which
keeps a prebuilt parameter block and skips the dispatcher, as the Output reducer does: an eager gather takes
127-158 µs of host time through the op and 36-38 µs without it (T = 1, two H200s).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .._runtime.device import current_stream_handle
from .._runtime.jit import bind_param_block
from .._runtime.jit import load as load_jit

__all__ = ["QueryDirectParams", "DirectLauncher", "load", "query_direct", "query_wait_acks", "sn_blocks_per_sm"]

MAX_WORLD = 8
_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class QueryDirectParams(ctypes.Structure):
    """Mirror of ``QueryDirectParams`` in ``csrc/query/direct.cu`` (same order, same types)."""

    _fields_ = [
        ("q_nope", _vp),
        ("q_pe", _vp),
        ("s_nt", _i64),
        ("s_nh", _i64),
        ("s_pt", _i64),
        ("s_ph", _i64),
        ("pos", _vp),
        ("cos_sin", _vp),
        ("max_pos", _i64),
        ("out", _vp),
        ("peer_base", ctypes.c_uint64 * MAX_WORLD),
        ("epochs", _vp),
        ("last_z", _vp),
        ("err", _vp),
        ("timeout_ns", _i64),
        ("max_tokens", _i64),
        ("data_off", _i64),
        ("slot_bytes", _i64),
        ("ll_off", _i64),
        ("ll_max_tokens", _i64),
        ("ll128_off", _i64),
        ("ll128_lines", _i64),
        ("sn_off", _i64),
        ("sn_max_tokens", _i64),
        ("quant_scale", ctypes.c_float),
        ("pos64", _i32),
        ("T", _i32),
        ("rank", _i32),
        ("W", _i32),
        ("H", _i32),
        ("HOUT", _i32),
        ("NOPE", _i32),
        ("ROPE", _i32),
        ("nprog", _i32),
        ("blocks", _i32),
        ("mode", _i32),
        ("neox", _i32),
        ("fp8", _i32),
        ("mech", _i32),
    ]


# The integer fields an object's launcher fills once (by name; the custom ops carry them as one list in this
# order). The rest: the state tensors and peer addresses (op arguments of their own) and the per-call fields.
FIXED_FIELDS = (
    "err",
    "timeout_ns",
    "max_tokens",
    "data_off",
    "slot_bytes",
    "ll_off",
    "ll_max_tokens",
    "ll128_off",
    "ll128_lines",
    "sn_off",
    "sn_max_tokens",
    "rank",
    "W",
    "H",
    "HOUT",
    "NOPE",
    "ROPE",
    "nprog",
    "neox",
    "fp8",
    "mech",
)


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once per source hash) and load ``libpeerdcp_query.so``; checks the parameter layout. Raises
    JitError without nvcc."""
    lib = load_jit("peerdcp_query")  # flags in peerdcp._runtime.jit.LIBRARIES (no fast math, no FMA contraction)
    bind_param_block(lib, ("peerdcp_query_direct", "peerdcp_query_wait_acks"), "peerdcp_query_params_size",
                     QueryDirectParams)  # fmt: skip
    lib.peerdcp_query_sn_blocks_per_sm.restype = ctypes.c_int
    lib.peerdcp_query_sn_blocks_per_sm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    return lib


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"peerdcp {what} launch failed: CUDA error {err}")


class DirectLauncher:
    """Launches the CUDA direct kernel (and the ack wait) for one QueryGather: the fixed fields are filled once.

    ``fixed``: every name of :data:`FIXED_FIELDS` (ints; ``err`` the error word's address, ``nprog`` the object's
    grid, ``neox`` / ``fp8`` 0 or 1)."""

    def __init__(
        self,
        *,
        peer_addrs: list[int] | tuple[int, ...],
        epochs: torch.Tensor,
        last_z: torch.Tensor,
        quant_scale: float,
        **fixed: int,
    ) -> None:
        if set(fixed) != set(FIXED_FIELDS):
            raise TypeError(f"DirectLauncher needs exactly the fields {FIXED_FIELDS}, got {sorted(fixed)}")
        if len(peer_addrs) > MAX_WORLD:
            raise ValueError(f"at most {MAX_WORLD} peers, got {len(peer_addrs)}")
        self._lib = load()
        p = QueryDirectParams()
        for i, a in enumerate(peer_addrs):
            p.peer_base[i] = a
        p.epochs, p.last_z, p.quant_scale = epochs.data_ptr(), last_z.data_ptr(), quant_scale
        for name in FIXED_FIELDS:
            setattr(p, name, int(fixed[name]))
        self._p, self._pp, self._size = p, ctypes.byref(p), ctypes.sizeof(p)
        self._epochs, self._last_z = epochs, last_z  # keep alive
        # what the custom ops carry (under torch.compile)
        self._peers = [int(a) for a in peer_addrs]
        self._quant = float(quant_scale)
        self._fixed = [int(fixed[name]) for name in FIXED_FIELDS]

    @classmethod
    def _from_op(cls, epochs, last_z, peer_addrs, quant_scale, fixed) -> DirectLauncher:
        return cls(
            peer_addrs=peer_addrs,
            epochs=epochs,
            last_z=last_z,
            quant_scale=quant_scale,
            **dict(zip(FIXED_FIELDS, fixed)),
        )

    def __call__(
        self,
        mode: int,
        T: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        out: torch.Tensor,
        blocks: int = 0,
    ) -> None:
        """One call of ``mode`` (``kernels.MODE_*`` plus bits) with ``T`` tokens on the current stream: ``q_nope
        [>= T, H, NOPE]`` / ``q_pe [>= T, H, ROPE]`` bf16 (strides in elements; an exposed call passes the whole
        exposed shard, ``max_tokens`` rows, so T is never read from a shape), ``positions [T]`` int32/int64,
        ``cos_sin_cache [max_pos, ROPE]`` fp32, ``out [T, HOUT, NOPE + ROPE]``. ``blocks``: this launch's grid (0: the
        object's), fewer only for the flag-free push modes (LL, LL12, LL128, SN)."""
        if torch.compiler.is_compiling():
            torch.ops.peerdcp.query_direct(
                q_nope, q_pe, positions, cos_sin_cache, out, self._epochs, self._last_z,
                self._peers, self._quant, self._fixed, mode, T, blocks,
            )  # fmt: skip
            return
        self._fill(mode, T, q_nope, q_pe, positions, cos_sin_cache, out, blocks)
        stream = current_stream_handle(out.device)
        _check(self._lib.peerdcp_query_direct(self._pp, self._size, stream), "query_direct")

    def _fill(self, mode, T, q_nope, q_pe, positions, cos_sin_cache, out, blocks) -> None:
        """The call's fields of the parameter block, without a launch."""
        p = self._p
        p.q_nope, p.q_pe = q_nope.data_ptr(), q_pe.data_ptr()
        p.s_nt, p.s_nh = q_nope.stride(0), q_nope.stride(1)
        p.s_pt, p.s_ph = q_pe.stride(0), q_pe.stride(1)
        p.pos, p.pos64 = positions.data_ptr(), int(positions.dtype == torch.int64)
        p.cos_sin, p.max_pos = cos_sin_cache.data_ptr(), cos_sin_cache.shape[0]
        p.out = out.data_ptr()
        p.T, p.mode, p.blocks = T, mode, blocks

    def wait_acks(self) -> None:
        """The zero-copy ack wait (``exposed_shard``) on the current stream."""
        if torch.compiler.is_compiling():
            torch.ops.peerdcp.query_wait_acks(self._last_z, self._peers, self._fixed)
            return
        stream = current_stream_handle(self._last_z.device)
        _check(self._lib.peerdcp_query_wait_acks(self._pp, self._size, stream), "query_wait_acks")


@torch.library.custom_op("peerdcp::query_direct", mutates_args=("out", "epochs", "last_z"))
def query_direct(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out: torch.Tensor,
    epochs: torch.Tensor,
    last_z: torch.Tensor,
    peer_addrs: list[int],
    quant_scale: float,
    fixed: list[int],
    mode: int,
    T: int,
    blocks: int,
) -> None:
    """One direct-kernel call (see :meth:`DirectLauncher.__call__`; ``fixed``: :data:`FIXED_FIELDS` in order)."""
    launcher = DirectLauncher._from_op(epochs, last_z, peer_addrs, quant_scale, fixed)
    launcher(mode, T, q_nope, q_pe, positions, cos_sin_cache, out, blocks)


@query_direct.register_fake
def _(q_nope, q_pe, positions, cos_sin_cache, out, epochs, last_z, peer_addrs, quant_scale, fixed, mode, T, blocks):
    return None


@torch.library.custom_op("peerdcp::query_wait_acks", mutates_args=("last_z",))
def query_wait_acks(last_z: torch.Tensor, peer_addrs: list[int], fixed: list[int]) -> None:
    """The zero-copy ack wait (see :meth:`DirectLauncher.wait_acks`)."""
    DirectLauncher._from_op(last_z, last_z, peer_addrs, 1.0, fixed).wait_acks()


@query_wait_acks.register_fake
def _(last_z, peer_addrs, fixed):
    return None


def sn_blocks_per_sm(neox: bool, fp8: bool) -> int:
    """Blocks of the sentinel-push kernels (interleaved FP8: the 8- and 16-byte ones) resident on one SM at once,
    on the current device (``cudaOccupancyMaxActiveBlocksPerMultiprocessor``: registers, shared memory, 256
    threads a block)."""
    n = ctypes.c_int(0)
    _check(load().peerdcp_query_sn_blocks_per_sm(int(neox), int(fp8), ctypes.byref(n)), "sn_blocks_per_sm")
    return int(n.value)
