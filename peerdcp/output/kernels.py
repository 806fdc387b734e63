"""Triton kernels of the Output/LSE exchange.

* :func:`direct_kernel` - the fused producer-direct exchange (publish -> release signal -> bounded
  acquire wait -> combine) in one launch. It is the interpreter path (``TRITON_INTERPRET=1`` on host
  shared memory, real processes) and the GPU twin of the CUDA kernel in ``csrc/output/direct.cu``;
  both implement the same protocol on the same inbox layout (:class:`InboxLayout`).
* :func:`combine_kernel` - the LSE combine of stacked received sources (the ``a2a`` baseline).
* :func:`correct_kernel` - the per-rank LSE correction before a reduce-scatter (the ``ag_rs`` baseline).

Combine rule (DESIGN.md section 3, ``reference.combine``): sanitize NaN/+inf -> -inf, ``m = max`` (0 if
-inf), ``w = b^(l - m)``, ``out = sum(w * o) / S``; a source with ``w == 0`` is masked out of the load,
so its payload (stale or NaN) never reaches the sum; every source empty -> 0 and LSE -inf.

Protocol of :func:`direct_kernel` (grid ``G`` programs, ``G`` fixed per reducer, independent of T):

* Work unit ``u = t * NC + c``: token ``t``, heads ``[c*HB, (c+1)*HB)`` of the destination's slice.
  Program ``p`` owns units ``p, p + G, p + 2G, ...``. Every rank runs the same T and the same G, so
  program p on rank A publishes exactly the units that program p on rank B combines, and waits only
  for flags raised by the peers' program p (the interpreter rule; on the GPU, ``G`` <= co-resident
  CTAs keeps it deadlock-free, and the bounded wait catches the rest).
* Program p keeps its own epoch counter ``epochs[p]`` (local memory, touched by no other program), so
  no cross-CTA coordination is needed; every program runs in every call, so the counters advance in
  lockstep and equal the number of calls made. ``slot = epoch % 2``.
* Flags: int64 ``[2 slots][G][W sources]`` in each destination's inbox; value
  ``epoch * TOKEN_SPACE + T`` (a peer that called with a different T never matches: it times out
  instead of silently combining stale rows).
* Why two slots suffice: rank A writes slot ``n % 2`` in call n only after its call n-1 finished
  (stream order), and call n-1 waited for B's call-(n-1) flags; B raised those after its call n-2 -
  the last reader of slot ``n % 2`` - had completed (stream order on B). So a slot is never
  overwritten while its reader may still read it, with no host sync and no barrier between calls.
* A source never publishes to itself: the combine reads its own slice from the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .._runtime.device import cast_rne, next_epoch, signal_release, to_f32, wait_equal

__all__ = ["TOKEN_SPACE", "InboxLayout", "direct_kernel", "combine_kernel", "correct_kernel", "heads_per_unit"]

# Flag value = epoch * TOKEN_SPACE + T (T < TOKEN_SPACE); also bounds max_tokens.
TOKEN_SPACE = 1 << 20
_ALIGN = 256


def _round_up(x: int, a: int = _ALIGN) -> int:
    return -(-x // a) * a


def ll128_lines(heads: int, head_dim: int, elem_size: int = 2) -> int:
    """128-byte LL128 lines per (slot, source, token) row: 15 data words of 8 bytes per line."""
    return -(-(heads * head_dim * elem_size // 8) // 15)


@dataclass(frozen=True)
class InboxLayout:
    """Byte layout of one rank's inbox (a :class:`~peerdcp.memory.PeerBuffer`), the same on every rank.

    ``flags  int64 [2, G, W]``               at ``flag_off``    (flag from source s, program p, slot k)
    ``lse    fp32  [2, W, max_tokens, H]``   at ``lse_off``     (source s's LSE for this rank's heads)
    ``payload dtype[2, W, max_tokens, H, D]`` at ``payload_off`` (source s's partial for this rank's heads)
    ``ll     u64   [2, W, ll_tokens, H*D/2 + H (+1 if H odd)]`` at ``ll_off``: the CUDA kernel's LL region
    (8-byte words {4 data bytes, 4 flag bytes}; absent when ``ll_tokens`` is 0)
    ``ll128  u64   [2, W, ll128_tokens, ll128_row_words]`` at ``ll128_off``: the CUDA kernel's LL128 region
    (``ll128_lines`` 128-byte lines of 15 data words + 1 flag word, then H LL words of LSE, padded to a line;
    absent when ``ll128_tokens`` is 0)
    ``sentinel dtype [2, W, sn_tokens, H, D]`` at ``sn_off``, then the LSE words at ``sn_lse_off``:
    the CUDA sentinel kernel's region (payload all 0xFF bytes at rest, then two 64-bit LSE words per entry:
    ``u64 [2, W, sn_tokens, H, 2]``; absent when ``sn_tokens`` is 0)

    Row ``[k, s]`` is written only by source s; the row of the inbox owner itself stays unused (its own
    slice is read from the input).
    """

    world_size: int
    programs: int
    max_tokens: int
    heads: int
    head_dim: int
    elem_size: int
    ll_tokens: int = 0
    ll128_tokens: int = 0
    sn_tokens: int = 0

    @property
    def flag_off(self) -> int:
        return 0

    @property
    def lse_off(self) -> int:
        return _round_up(2 * self.programs * self.world_size * 8)

    @property
    def payload_off(self) -> int:
        return self.lse_off + _round_up(2 * self.world_size * self.max_tokens * self.heads * 4)

    @property
    def ll_off(self) -> int:
        pay = 2 * self.world_size * self.max_tokens * self.heads * self.head_dim * self.elem_size
        return self.payload_off + _round_up(pay)

    @property
    def ll_row_words(self) -> int:
        return self.heads * (self.head_dim // 2) + self.heads + (self.heads & 1)

    @property
    def ll128_off(self) -> int:
        return self.ll_off + _round_up(2 * self.world_size * self.ll_tokens * self.ll_row_words * 8)

    @property
    def ll128_lines(self) -> int:
        return ll128_lines(self.heads, self.head_dim, self.elem_size)

    @property
    def ll128_row_words(self) -> int:
        return self.ll128_lines * 16 + -(-self.heads // 16) * 16

    @property
    def sn_off(self) -> int:
        return self.ll128_off + _round_up(2 * self.world_size * self.ll128_tokens * self.ll128_row_words * 8)

    @property
    def sn_payload_bytes(self) -> int:
        return 2 * self.world_size * self.sn_tokens * self.heads * self.head_dim * self.elem_size

    @property
    def sn_lse_off(self) -> int:
        return self.sn_off + _round_up(self.sn_payload_bytes)

    @property
    def nbytes(self) -> int:
        return self.sn_lse_off + _round_up(2 * self.world_size * self.sn_tokens * self.heads * 16)


def heads_per_unit(heads: int, head_dim: int, target_elems: int) -> int:
    """Heads per work unit: a power of two with about ``target_elems`` elements per unit (>= 1 head)."""
    hb = max(1, target_elems // triton.next_power_of_2(head_dim))
    return min(triton.next_power_of_2(heads), triton.next_power_of_2(hb))


@triton.jit
def _sanitize(l):
    return tl.where((l != l) | (l == float("inf")), float("-inf"), l)


@triton.jit
def _weight(l, m, BASE2: tl.constexpr):
    if BASE2:
        return tl.exp2(l - m)
    else:
        return tl.exp(l - m)


@triton.jit
def _merged_lse(m, s, BASE2: tl.constexpr):
    safe = tl.where(s > 0, s, 1.0)
    if BASE2:
        lg = tl.log2(safe)
    else:
        lg = tl.log(safe)
    return tl.where(s > 0, m + lg, float("-inf"))


@triton.jit
def direct_kernel(
    partial_out,  # [T, W*H, D] bf16/fp16, contiguous
    partial_lse,  # [T, W*H] fp32, contiguous
    out,  # [T, H, D], contiguous
    out_lse,  # [T, H] fp32 (written when RETURN_LSE)
    peer_ptrs,  # int64 [W]: inbox base of every rank, as seen by this process
    epochs,  # int64 [G]: this rank's per-program epoch counters
    err_addr,  # int: address of the int64[8] error word
    T,
    rank,
    G,
    max_tokens,
    lse_off,
    payload_off,
    timeout_ns,
    max_spins,
    W: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NC: tl.constexpr,
    BASE2: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    MECH: tl.constexpr,
    GPU: tl.constexpr,
):
    p = tl.program_id(0)
    e = next_epoch(epochs + p)
    slot = e % 2
    fv = e * 1048576 + T  # TOKEN_SPACE
    n_units = T * NC
    if p < n_units:  # a program without units only advances its epoch (its peers' twins are idle too)
        hh = tl.arange(0, HB)
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        ELT = partial_out.dtype.element_ty
        # ---- publish: every destination's head slice and LSE, straight into its inbox
        # (while loops: the interpreter cannot use a runtime scalar as a range() bound)
        u = p
        while u < n_units:
            t = (u // NC).to(tl.int64)
            heads = (u % NC) * HB + hh
            hm = heads < H
            m2 = hm[:, None] & dmask[None, :]
            row = ((slot * W + rank) * max_tokens + t) * H + heads  # [HB] rows of the inbox
            for d in tl.static_range(W):
                if d != rank:
                    x = tl.load(partial_out + (t * (W * H) + d * H + heads)[:, None] * D + dd[None, :], mask=m2)
                    base = tl.load(peer_ptrs + d)
                    pay = (base + payload_off).to(tl.pointer_type(ELT))
                    tl.store(pay + row[:, None] * D + dd[None, :], x, mask=m2)
                    lv = tl.load(partial_lse + t * (W * H) + d * H + heads, mask=hm)
                    tl.store((base + lse_off).to(tl.pointer_type(tl.float32)) + row, lv, mask=hm)
            u += G
        # ---- release-signal every destination (fence: payload before flag)
        for d in tl.static_range(W):
            if d != rank:
                base = tl.load(peer_ptrs + d)
                flag = base.to(tl.pointer_type(tl.int64)) + (slot * G + p) * W + rank
                signal_release(flag, fv, GPU)
        # ---- bounded acquire-wait for every source's twin program
        me = tl.load(peer_ptrs + rank)
        okbits = (p * 0).to(tl.int32) | (1 << rank)
        for s in tl.static_range(W):
            if s != rank:
                fl = me.to(tl.pointer_type(tl.int64)) + (slot * G + p) * W + s
                ok = wait_equal(fl, fv, err_addr, timeout_ns, max_spins, rank, s, MECH, GPU)
                okbits = okbits | (ok.to(tl.int32) << s)
        in_lse = (me + lse_off).to(tl.pointer_type(tl.float32))
        in_pay = (me + payload_off).to(tl.pointer_type(ELT))
        # ---- combine this program's units (a source whose wait failed counts as empty)
        u = p
        while u < n_units:
            t = (u // NC).to(tl.int64)
            heads = (u % NC) * HB + hh
            hm = heads < H
            m2 = hm[:, None] & dmask[None, :]
            mx = tl.full([HB], float("-inf"), tl.float32)
            for s in tl.static_range(W):
                oks = ((okbits >> s) & 1) != 0
                if s == rank:
                    l = tl.load(partial_lse + t * (W * H) + rank * H + heads, mask=hm, other=float("-inf"))
                else:
                    l = tl.load(
                        in_lse + ((slot * W + s) * max_tokens + t) * H + heads,
                        mask=hm & oks,
                        other=float("-inf"),
                        cache_modifier=".cg",
                    )
                mx = tl.maximum(mx, _sanitize(l))
            mx = tl.where(mx == float("-inf"), 0.0, mx)
            ssum = tl.zeros([HB], tl.float32)
            acc = tl.zeros([HB, BLOCK_D], tl.float32)
            for s in tl.static_range(W):
                oks = ((okbits >> s) & 1) != 0
                if s == rank:
                    l = tl.load(partial_lse + t * (W * H) + rank * H + heads, mask=hm, other=float("-inf"))
                    w = _weight(_sanitize(l), mx, BASE2)
                    x = tl.load(
                        partial_out + (t * (W * H) + rank * H + heads)[:, None] * D + dd[None, :],
                        mask=m2 & (w > 0)[:, None],
                        other=0.0,
                    )
                else:
                    l = tl.load(
                        in_lse + ((slot * W + s) * max_tokens + t) * H + heads,
                        mask=hm & oks,
                        other=float("-inf"),
                        cache_modifier=".cg",
                    )
                    w = _weight(_sanitize(l), mx, BASE2)
                    rows = ((slot * W + s) * max_tokens + t) * H + heads
                    x = tl.load(
                        in_pay + rows[:, None] * D + dd[None, :],
                        mask=m2 & (w > 0)[:, None],
                        other=0.0,
                        cache_modifier=".cg",
                    )
                ssum += w
                acc += tl.where((w > 0)[:, None], w[:, None] * to_f32(x, GPU), 0.0)
            res = acc / tl.where(ssum > 0, ssum, 1.0)[:, None]
            res = cast_rne(res, out.dtype.element_ty, GPU)
            tl.store(out + (t * H + heads)[:, None] * D + dd[None, :], res, mask=m2)
            if RETURN_LSE:
                tl.store(out_lse + t * H + heads, _merged_lse(mx, ssum, BASE2), mask=hm)
            u += G


@triton.jit
def combine_kernel(
    recv,  # [N, T, H, D] (any strides; D contiguous)
    recv_lse,  # [N, T, H] fp32 (any strides)
    out,  # [T, H, D] contiguous
    out_lse,  # [T, H] fp32 contiguous (written when RETURN_LSE)
    s_n,
    s_t,
    s_h,
    l_n,
    l_t,
    l_h,
    N: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BASE2: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    GPU: tl.constexpr,
):
    """Grid ``(T, cdiv(H, HB))``: combine N received sources for HB heads of one token."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < H
    dd = tl.arange(0, BLOCK_D)
    m2 = hm[:, None] & (dd < D)[None, :]
    mx = tl.full([HB], float("-inf"), tl.float32)
    # the source index in int64 (t * 0 + i): Triton passes a stride below 2^31 as int32, and i * s_n passes 2^31 at
    # large T (W = 8, 16 heads of 512 from ~37K tokens): in int32 it wrapped and read ~4 GiB before the buffer
    for i in tl.static_range(N):
        l = tl.load(recv_lse + (t * 0 + i) * l_n + t * l_t + heads * l_h, mask=hm, other=float("-inf"))
        mx = tl.maximum(mx, _sanitize(l))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    ssum = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, BLOCK_D], tl.float32)
    for i in tl.static_range(N):
        l = tl.load(recv_lse + (t * 0 + i) * l_n + t * l_t + heads * l_h, mask=hm, other=float("-inf"))
        w = _weight(_sanitize(l), mx, BASE2)
        x = tl.load(
            recv + (t * 0 + i) * s_n + t * s_t + heads[:, None] * s_h + dd[None, :],
            mask=m2 & (w > 0)[:, None],
            other=0.0,
        )
        ssum += w
        acc += tl.where((w > 0)[:, None], w[:, None] * to_f32(x, GPU), 0.0)
    res = cast_rne(acc / tl.where(ssum > 0, ssum, 1.0)[:, None], out.dtype.element_ty, GPU)
    tl.store(out + (t * H + heads)[:, None] * D + dd[None, :], res, mask=m2)
    if RETURN_LSE:
        tl.store(out_lse + t * H + heads, _merged_lse(mx, ssum, BASE2), mask=hm)


@triton.jit
def correct_kernel(
    partial_out,  # [T, W*H, D] contiguous (this rank's partial)
    lses,  # [W, T, W*H] fp32 contiguous (every rank's LSE, all-gathered)
    corrected,  # [W (destination), T, H, D] fp32 contiguous
    out_lse,  # [T, H] fp32 (this rank's heads; written when RETURN_LSE)
    T,
    rank,
    W: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BASE2: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    GPU: tl.constexpr,
):
    """Grid ``(T, W * cdiv(H, HB))``: scale this rank's partial by ``w_rank / S`` for HB widened heads of one
    destination (0 - not ``0 * payload`` - where the weight is 0); the reduce-scatter then sums over ranks."""
    t = tl.program_id(0).to(tl.int64)
    nc = tl.cdiv(H, HB)
    d = tl.program_id(1) // nc
    heads = (tl.program_id(1) % nc) * HB + tl.arange(0, HB)
    hm = heads < H
    dd = tl.arange(0, BLOCK_D)
    m2 = hm[:, None] & (dd < D)[None, :]
    col = d * H + heads
    mx = tl.full([HB], float("-inf"), tl.float32)
    for s in tl.static_range(W):
        l = tl.load(lses + (s * T + t) * (W * H) + col, mask=hm, other=float("-inf"))
        mx = tl.maximum(mx, _sanitize(l))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    ssum = tl.zeros([HB], tl.float32)
    for s in tl.static_range(W):
        l = tl.load(lses + (s * T + t) * (W * H) + col, mask=hm, other=float("-inf"))
        ssum += _weight(_sanitize(l), mx, BASE2)
    lr = tl.load(lses + (rank * T + t) * (W * H) + col, mask=hm, other=float("-inf"))
    wr = _weight(_sanitize(lr), mx, BASE2)
    x = tl.load(partial_out + (t * (W * H) + col)[:, None] * D + dd[None, :], mask=m2 & (wr > 0)[:, None], other=0.0)
    scale = wr / tl.where(ssum > 0, ssum, 1.0)
    y = tl.where((wr > 0)[:, None], scale[:, None] * to_f32(x, GPU), 0.0)
    tl.store(corrected + ((d * T + t) * H + heads)[:, None] * D + dd[None, :], y, mask=m2)
    if RETURN_LSE:  # noqa: SIM102 - constexpr branch, then a runtime one
        if d == rank:
            tl.store(out_lse + t * H + heads, _merged_lse(mx, ssum, BASE2), mask=hm)
