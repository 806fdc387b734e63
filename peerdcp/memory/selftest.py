"""A peer-memory round trip through a Triton kernel: the smallest use of the exchange protocol.

Used by the foundation tests, by ``peerdcp run`` and by the GPU check script. Layout of the buffer:
``flags int64 [2, W]`` (flag written by source s at ``[e % 2, s]``), then ``inbox int32 [2, W, N]`` (row
``[e % 2, s]`` written by source s in round e). One program publishes a pattern into every peer's inbox
row, signals, waits for every peer's signal, and copies its inbox out.

Why two slots: source s writes round e+2 into slot e % 2 only after it saw our round-(e+1) signal, and
we send that only after we finished reading round e. With one slot, a fast peer overwrites data we
have not read yet (the W = 4 test catches exactly that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.device import ErrorWord, mechanism_code, on_gpu, peer_pointer, signal_release, spin_budget, wait_equal
from .buffer import PeerBuffer

__all__ = ["roundtrip", "roundtrip_nbytes", "expected_pattern"]


def roundtrip_nbytes(world_size: int, n: int) -> int:
    return 2 * (8 * world_size + 4 * world_size * n)


def expected_pattern(src: int, dst: int, epoch: int, n: int) -> torch.Tensor:
    return epoch * 1_000_000 + src * 1000 + dst * 100 + torch.arange(n, dtype=torch.int32) % 97


# epoch must not be specialised: Triton turns an int argument equal to 1 into a constexpr on the GPU.
@triton.jit(do_not_specialize=["epoch", "rank"])
def _roundtrip_kernel(
    peer_ptrs,
    out,
    err_addr,
    epoch,
    rank,
    W: tl.constexpr,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    timeout_ns,
    max_spins,
    MECH: tl.constexpr,
    GPU: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    m = offs < N
    slot = epoch % 2
    for d in range(W):
        base = peer_pointer(peer_ptrs, d, tl.int64)
        inbox = (base + 2 * W).to(tl.pointer_type(tl.int32)) + (slot * W + rank) * N
        val = epoch * 1000000 + rank * 1000 + d * 100 + offs % 97
        tl.store(inbox + offs, val.to(tl.int32), mask=m)
        signal_release(base + slot * W + rank, epoch.to(tl.int64), GPU)
    me = peer_pointer(peer_ptrs, rank, tl.int64)
    for s in range(W):
        ok = wait_equal(me + slot * W + s, epoch.to(tl.int64), err_addr, timeout_ns, max_spins, rank, s, MECH, GPU)
        src = (me + 2 * W).to(tl.pointer_type(tl.int32)) + (slot * W + s) * N
        x = tl.load(src + offs, mask=m & ok, other=-1, cache_modifier=".cg")
        tl.store(out + s * N + offs, x, mask=m)


def roundtrip(buf: PeerBuffer, epoch: int, n: int, *, timeout_s: float = 10.0) -> torch.Tensor:
    """Run one round (every rank must call it with the same ``epoch`` > previous); returns ``int32 [W, n]``:
    row s is what rank s wrote into this rank's inbox. Raises PeerTimeoutError if a peer never came."""
    W = buf.world_size
    if buf.nbytes < roundtrip_nbytes(W, n):
        raise ValueError(f"buffer too small: need {roundtrip_nbytes(W, n)} bytes")
    err = ErrorWord(buf.device, timeout_s)
    out = torch.full((W, n), -7, dtype=torch.int32, device=buf.device)
    _roundtrip_kernel[(1,)](
        buf.peer_ptrs,
        out,
        err.kernel_arg(),
        epoch,
        buf.rank,
        W,
        n,
        triton.next_power_of_2(n),
        int(timeout_s * 1e9),
        spin_budget(timeout_s, buf.device),
        mechanism_code("signal-test"),
        on_gpu(buf.device),
    )
    if buf.device.type == "cuda":
        torch.cuda.synchronize(buf.device)
    err.raise_if_set()
    return out
