"""Kernel support shared by every mechanism: the one place that knows GPU from interpreter.

The same ``@triton.jit`` kernels run on CUDA GPUs and under ``TRITON_INTERPRET=1`` on host shared
memory (real processes, real protocol). Every GPU-only instruction lives here behind the constexpr
``GPU`` flag, so the interpreter path never meets inline PTX:

* :func:`fence_system` - ``fence.acq_rel.sys`` on GPU. The interpreter runs loads/stores as numpy
  operations on shared pages in program order (x86 is TSO), so it needs no fence.
* :func:`signal_release` - every thread fences its own payload stores system-wide, the CTA barrier
  orders them before the flag, then one release store of the flag (so a peer that acquires the flag
  sees every byte of the payload).
* :func:`wait_equal` - bounded acquire poll: ``%globaltimer`` deadline on GPU, a spin budget in the
  interpreter (calibrated to the same ``timeout_s``). On expiry it records (rank, peer, mechanism,
  epoch) in the error word and returns 0 instead of hanging or trapping.
* :func:`grid_dependency_sync` - programmatic dependent launch (PDL, sm_90+): let the next kernel on the
  stream start launching, then wait until the previous kernel finished and its stores are visible. A kernel
  launched with PDL calls it before its first memory access; nothing is done when ``PDL`` is 0.
* :func:`to_f32` / :func:`f32_to_bf16_bits` / :func:`cast_rne` - exact widening and round-to-nearest-even
  narrowing. The GPU converts; Triton 3.6's interpreter converts bf16 *subnormals* wrongly both ways
  (1.01e-39 -> 4.41e-39 widening, 1.84e-39 -> 0 narrowing) and truncates fp32 -> bf16, so there bf16 goes
  through its bits (fp16 converts correctly there).
* :data:`LOAD_BYPASS_L1` - cache modifier for inbox loads after an acquire (``.cg``: L2, never L1,
  so no stale line from an earlier use of the same slot is read).

Peer addresses are int64 tables (``PeerBuffer.peer_ptrs``) cast with :func:`peer_pointer`. Host side:
:class:`ErrorWord` (the timeout report each call checks) and :func:`current_stream_handle` (the stream of a ctypes
launch).
"""

from __future__ import annotations

import functools
import os
import time

import torch
import triton
import triton.language as tl

from ..errors import MECHANISMS, PeerTimeoutError
from .checks import cuda_index

__all__ = [
    "INTERPRET",
    "ON_GPU",
    "LOAD_BYPASS_L1",
    "fence_system",
    "signal_release",
    "poll_acquire",
    "next_epoch",
    "wait_equal",
    "peer_pointer",
    "ErrorWord",
    "spin_budget",
    "mechanism_code",
    "num_sms",
    "current_stream_handle",
    "grid_dependency_sync",
    "to_f32",
    "f32_to_bf16_bits",
    "cast_rne",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOAD_BYPASS_L1: str = ".cg"


def on_gpu(device: torch.device) -> bool:
    """True when kernels for ``device`` are compiled for the GPU (constexpr ``GPU`` argument)."""
    return device.type == "cuda" and not INTERPRET


ON_GPU = on_gpu  # alias kept short for call sites


# torch's own raw-stream getter (what Inductor's generated launchers call) skips building a Stream object and
# resolving the device on every eager launch; absent on CPU builds, where the public path is the fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: torch.device) -> int:
    """The ``cudaStream_t`` (as an int) of the current stream on CUDA ``device``, for ctypes launches.
    ValueError for a non-CUDA device: a launch must never take the current device's stream for host tensors."""
    if device.type != "cuda":
        raise ValueError(f"a CUDA launch needs tensors on a CUDA device, got {device}")
    index = cuda_index(device)
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


@functools.cache
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once per device: launch-time grid rules use it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def to_f32(x, GPU: tl.constexpr):
    """A bf16 / fp16 / fp32 tensor as fp32, exactly (interpreter: bf16 widened from its bits)."""
    if not GPU:  # noqa: SIM102 - constexpr branches
        if x.dtype == tl.bfloat16:
            x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def f32_to_bf16_bits(v):
    """Round-to-nearest-even fp32 -> bf16 bits (in int32, low 16 bits), by integer arithmetic; NaN stays NaN
    (quiet bit set: a payload only in the low 16 bits would otherwise round to inf or carry into the sign)."""
    bits = v.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where(a > 0x7F800000, (bits >> 16) | 0x40, r)
    return r & 0xFFFF


@triton.jit
def cast_rne(x, OUT_T: tl.constexpr, GPU: tl.constexpr):
    """fp32 ``x`` -> ``OUT_T`` (bf16 / fp16 / fp32), round to nearest even (interpreter: bf16 from its bits)."""
    if not GPU:  # noqa: SIM102 - constexpr branches
        if OUT_T == tl.bfloat16:  # noqa: SIM300
            x = f32_to_bf16_bits(x).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(OUT_T)


@triton.jit
def fence_system(GPU: tl.constexpr):
    if GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """PDL = 1: wait for the previous kernel (``griddepcontrol.wait``); PDL = 2: first allow the next kernel
    to launch (``griddepcontrol.launch_dependents``), then wait. 0: nothing (non-PDL launches, interpreter).

    Triggering first is safe: the dependents launch once *every* program of this grid has triggered (so only
    into slots our last wave leaves free), and a dependent reads nothing before its own wait, which returns
    only after this whole grid completed and flushed its stores.
    """
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()


@triton.jit
def peer_pointer(table, r, ELEM: tl.constexpr):
    """Rank ``r``'s base address from an int64 pointer table, as a pointer to ``ELEM``, declared 16-byte aligned
    (``PeerBuffer`` checks it). A loaded address is of unknown alignment to the compiler otherwise, and Triton
    3.6 on sm_90 has stored byte tiles wrongly through such pointers (see the Query kernels' ``_slot_pointer``)."""
    return tl.multiple_of(tl.load(table + r).to(tl.pointer_type(ELEM)), 16)


@triton.jit
def signal_release(flag_ptr, value, GPU: tl.constexpr):
    """Publish ``value`` at ``flag_ptr`` (int64, possibly a peer's) after this program's earlier stores."""
    fence_system(GPU)
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def next_epoch(counter_ptr):
    """Advance the program's int64 call counter at ``counter_ptr`` (local memory, this program's alone) and
    return the new value, the same in every thread.

    Every thread loads the counter; the CTA barrier then orders all of those loads before the one store
    (bar.sync orders memory operations across the CTA's threads). Without it a warp that reaches the load
    late can read the already-incremented counter and run the call with epoch + 2: the other parity slot
    and a flag value no peer sends. On H200 that showed as 1-2 wrong rows in 10,000 graph replays and as
    timed-out waits in the Triton Query twin; a scalar load + store is not atomic across warps.
    """
    e = tl.load(counter_ptr) + 1
    tl.debug_barrier()
    tl.store(counter_ptr, e)
    return e


@triton.jit
def poll_acquire(flag_ptr):
    return tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


# Bounded acquire poll of one int64 flag by one thread: $0 = the last value read, $1 = flag address,
# $2 = awaited value, $3 = timeout (ns, from this asm's own first %globaltimer read). Labels are local to
# the braces, so the asm may be inlined any number of times.
_POLL_ASM = tl.constexpr(
    """{
.reg .pred %pq, %pl;
.reg .b64 %t0, %tn;
mov.u64 %t0, %globaltimer;
POLL:
ld.acquire.sys.global.b64 $0, [$1];
setp.eq.s64 %pq, $0, $2;
@%pq bra DONE;
mov.u64 %tn, %globaltimer;
sub.s64 %tn, %tn, %t0;
setp.lt.s64 %pl, %tn, $3;
@%pl bra POLL;
DONE:
}"""
)


@triton.jit
def _block_min(x):
    """The minimum of the int32 scalar ``x`` over every thread of the program (uniform afterwards).

    An opaque per-lane copy turns the scalar into a [1024] tensor spread over every warp, so the reduction
    crosses warps through shared memory; a plain splat would be folded back into the thread's own value.
    """
    v = tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [tl.zeros([1024], tl.int32) + x], dtype=tl.int32, is_pure=False, pack=1
    )
    return tl.min(v, axis=0)


@triton.jit
def error_word(err_addr):
    """The int64 error word at address ``err_addr`` (a Python-int kernel argument) as a pointer. Widened to 64 bits
    through uint64 first: an address below 2^32 arrives as a 32-bit scalar (ints are typed by value: int32 below
    2^31, uint32 below 2^32; a non-PIE Python's heap lies there, as on the GPU machines' CPU test runs), and the
    interpreter cannot bitcast 4 bytes to a pointer (nor a uint32 widened straight to int64). On the GPU the
    casts are free (a zero / sign extension of a positive value, or nothing)."""
    return err_addr.to(tl.uint64).to(tl.int64).to(tl.pointer_type(tl.int64))


@triton.jit
def wait_equal(flag_ptr, value, err_addr, timeout_ns, max_spins, my_rank, peer, mech, GPU: tl.constexpr):
    """Acquire-poll the int64 at ``flag_ptr`` until it equals ``value``; True on success.

    On timeout the first failing wait of the object writes ``[1, my_rank, peer, mech, value]`` into the
    int64 error word at address ``err_addr`` (host-visible memory) and returns False: the caller skips
    the data it waited for, and the host raises PeerTimeoutError at the next call.
    """
    if GPU:
        # Every thread polls the flag on its own inside one asm loop (no CTA barrier inside the loop), then
        # one block reduction makes the outcome uniform. Triton lowers a scalar atomic to "one thread
        # issues it, the block reads it back from shared memory between two barriers"; a poll loop built
        # from that has barriers in every iteration, and a twin of this loop hangs unboundedly on H200 while the
        # same protocol in CUDA C++ does not.
        lane = tl.arange(0, 32)  # one element per thread at any num_warps (replicated across warps)
        got = tl.inline_asm_elementwise(
            _POLL_ASM,
            "=l,l,l,l",
            [
                tl.zeros([32], tl.int64) + flag_ptr.to(tl.int64) + lane * 0,
                tl.zeros([32], tl.int64) + value.to(tl.int64),
                tl.zeros([32], tl.int64) + timeout_ns,
            ],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
        # the [32] reduction stays inside each warp (redux.sync); warps may disagree when the flag lands at
        # the deadline, so take the minimum over the whole block once more
        ok = _block_min(tl.min((got == value).to(tl.int32), axis=0)) != 0
    else:
        # The interpreter runs a grid's programs one after another: once one wait of the object has timed out (its
        # error word set, so the host raises at the next call), a later program's wait returns at once, or a call
        # would take grid x timeout_s to fail instead of timeout_s (the GPU's programs wait concurrently).
        v = poll_acquire(flag_ptr)
        n = 0
        if poll_acquire(error_word(err_addr)) != 0:
            n = max_spins
        while (v != value) & (n < max_spins):
            v = poll_acquire(flag_ptr)
            n += 1
        ok = v == value
    if ok == 0:
        err = error_word(err_addr)
        zero = value.to(tl.int64) * 0  # int64 operands; rank/peer/mech may be Python ints or constexprs
        if tl.atomic_cas(err, zero, zero + 1, sem="relaxed", scope="sys") == 0:
            tl.store(err + 1, zero + my_rank)
            tl.store(err + 2, zero + peer)
            tl.store(err + 3, zero + mech)
            tl.store(err + 4, value.to(tl.int64))
    return ok


def mechanism_code(name: str) -> int:
    return MECHANISMS.index(name) + 1


@functools.cache
def _interp_spins_per_second() -> float:
    """How many acquire polls the interpreter makes per second (measured once per process)."""
    flag = torch.zeros(8, dtype=torch.int64)
    err = torch.zeros(8, dtype=torch.int64)
    _spin_probe[(1,)](flag, err, 10)  # first call pays the interpreter's one-off costs
    n = 2000
    t0 = time.perf_counter()
    _spin_probe[(1,)](flag, err, n)
    dt = time.perf_counter() - t0
    return max(n / max(dt, 1e-6), 100.0)


@triton.jit
def _spin_probe(flag, err, n):
    i = 0
    v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    while (v != 1) & (i < n):
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        i += 1
    tl.store(err, i.to(tl.int64))


def spin_budget(timeout_s: float, device: torch.device) -> int:
    """Spin budget for the interpreter path so a wait lasts about ``timeout_s`` (GPU uses the timer)."""
    if on_gpu(device):
        return 0
    return max(int(timeout_s * _interp_spins_per_second()), 1)


class ErrorWord:
    """int64 ``[8]`` the kernels write on timeout: ``[set, rank, peer, mechanism, epoch, ...]``.

    On CUDA it lives in pinned, device-mapped host memory: the host reads it at the start of each call
    without synchronising the stream (a timeout is reported by the *next* call or by ``check()``).
    """

    def __init__(self, device: torch.device, timeout_s: float):
        self.timeout_s = timeout_s
        self.tensor = torch.zeros(8, dtype=torch.int64, pin_memory=device.type == "cuda")
        # a numpy view of the same (pinned) words: every call reads word 0, and indexing the tensor costs ~4 us of
        # host time per read against ~0.1 us here
        self.words = self.tensor.numpy()
        self.device = device

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    def kernel_arg(self) -> int:
        """What a kernel receives: the word's address (host memory; UVA-mapped on CUDA)."""
        return self.addr

    def reset(self) -> None:
        self.tensor.zero_()

    def error(self) -> PeerTimeoutError:
        """The timeout the words report (call only when word 0 is set)."""
        rank, peer, mech, epoch = (int(x) for x in self.words[1:5])
        name = MECHANISMS[mech - 1] if 1 <= mech <= len(MECHANISMS) else f"mechanism {mech}"
        return PeerTimeoutError(rank, peer, name, epoch, self.timeout_s)

    def raise_if_set(self) -> None:
        if self.words[0] != 0:
            raise self.error()
