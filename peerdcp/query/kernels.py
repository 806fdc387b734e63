"""Triton kernels of the Query gather: the consumer-direct kernel, its zero-copy ack wait, and the fused
RoPE + quantize kernel of the allgather baseline. The same kernels run on CUDA GPUs and under
``TRITON_INTERPRET=1`` on host shared memory (the CPU tests run the real protocol across processes).

Row math (shared by every kernel, so every path rounds identically; see ``reference.py``): a *unit* is
one (token, head) row of 576 = nope + rope values. ``_rows_compute`` (in ``rows.py``, with the other row helpers)
turns the bf16 nope/pe of BU units
into output bits: nope ``x * quant_scale`` and rotated pe ``(x0*c - x1*s) * quant_scale`` /
``(x0*s + x1*c) * quant_scale``, each product and sum rounded to fp32 (kernels are launched with
``enable_fp_fusion=False``), then a saturating RNE cast to e4m3 (or RNE bf16). The interpreter's own
float8/bf16 casts truncate, so off the GPU the casts are done on the integer bits (``_f32_to_e4m3_bits``
here, ``_runtime.device.cast_rne``; checked bit-for-bit against torch over every e4m3 midpoint in the
tests), and bf16 inputs are widened from their bits (``_runtime.device.to_f32``).

Exposed buffer of each rank (``PeerBuffer``, zero-filled; offsets in bytes)::

    [0, HDR)     int64 ready[2][NPROG][W]  ready[e % 2][p][s] = e: rank s's program p published call e
                 int64 ack[NPROG][W]       ack[p][d] = e: rank d's program p finished reading our slot Z
                                           in (exposed) call e
    [HDR, ...)   slot 0, slot 1, slot Z; each SLOT bytes:
                   raw slot:   bf16 nope [max_tokens, H, nope], then bf16 pe [max_tokens, H, rope]
                   roped slot: out-dtype [max_tokens, H, nope + rope] (rotated and converted)
                   push slot:  W regions, region s = rank s's rows as in a roped slot (written by s)

Work split: the grid has NPROG programs on every rank, for every T. Program p owns the contiguous
units ``[p*ceil(T*H/NPROG), ...)`` of *every* source rank's shard, so a program only ever waits for the
flag that the peers' program p (its twin) raises - no cross-program coordination, and the
interpreter (which runs programs one after another) cannot deadlock. Each program keeps its own
call counter ``epochs[p]`` in local device memory and bumps it on every call (with or without work),
so all counters equal the call count and the parity ``e % 2`` is the same for every program.

Modes (constexpr MODE):

* ``MODE_RAW`` (copy, raw exchange): program p copies its units of the caller's bf16 shard into its
  own slot ``e % 2``, signals, rotates/converts its own rows into the output, then waits for each
  peer's twin and rotates/converts the peer's raw rows straight from the peer's slot.
* ``MODE_ROPED`` (copy, roped exchange): program p rotates/converts its own units once, writes the
  result to the output and to its own slot ``e % 2`` (half the NVLink bytes for FP8), signals; the
  consumers copy the finished rows.
* ``MODE_PUSH`` (push, roped rows): program p rotates/converts its own units once and stores them into
  the output and into its region of every peer's slot ``e % 2`` (NVLink stores, which overlap the
  conversion; no remote loads), signals; the consumers copy the rows the peers stored into their own
  slot. Same two-slot argument as the copy modes below: every access of call e to any slot of parity k
  (by its owner or a peer) finishes before any access of call e + 2, whichever modes the calls use.
* ``MODE_PUSH_LL`` (CUDA kernel only, small calls): the push publish with NCCL's LL protocol - every 8
  output bytes travel with their flag in one 16-byte line into a separate LL area, and consumers poll the
  lines instead of a ready flag (``csrc/query/direct.cu``); this Triton kernel never receives it.
* ``MODE_PUSH_LL12`` (CUDA kernel only): ``MODE_PUSH_LL`` with lines of 12 data bytes and a 4-byte flag.
* ``MODE_PUSH_SN`` (CUDA kernel only, FP8 output): ``MODE_PUSH_LL``'s publish with no flag at all - every 8
  output bytes replace a rest pattern in a separate sentinel area, and the consumer puts the pattern back.
* ``MODE_PUSH_LL128`` (CUDA kernel only, medium calls): the same with NCCL's LL128 lines (15 data words and
  a flag word per 128-byte line) in a separate LL128 area; also never sent to this kernel.
* ``MODE_EXPOSED`` (zero-copy): the caller already wrote its bf16 shard into slot Z (the views of
  ``QueryGather.exposed_shard``); program p only signals, then consumes like RAW from the peers'
  slot Z, and acknowledges each peer after reading it.

Why two slots are enough (copy modes). Rank s writes slot k in call e and next in call e + 2. Before
its call e + 2 starts, its call e + 1 finished, and that needed a flag of call e + 1 from every peer d
(some program of d, for T >= 1). d raises a call-(e+1) flag only inside its call e + 1, i.e. after its
call e - every read of s's slot k in call e - completed (kernels of one stream run in order). So no
read of call e can see the bytes of call e + 2. One slot is not enough: s writes call e + 1 as soon as
it finished call e, while a slower d may still be reading call e. The ready flags use the same parity:
d overwrites ready[k][p][d] (value e) on s with e + 2 only after s raised its call-(e+1) flag, i.e.
after s's program p stopped waiting for e.

Deadlock freedom on the GPU: a program waits only for its twins on the peers, never for a program of
its own GPU, and publishes before it waits. The twins make progress as long as the peers dispatch
programs in block order (which the hardware does), so no residency of the whole grid is assumed;
NPROG = 2 per SM keeps it resident anyway when nothing else runs.

Why acks (zero-copy). The model writes slot Z (a fixed address baked into a CUDA graph) before the
gather kernel runs, so parity cannot protect it: ``exposed_shard`` launches ``_wait_acks_kernel``
first, which waits until every peer acknowledged (``ack[p][d] == last_z[p]``, the epoch of program p's
last exposed call with work) reading slot Z; the ack is a release after the reads, the wait an
acquire, so the reads happen before the projection's writes. A peer cannot ack a newer exposed call
early: it reads our slot Z only after our ready flag, which we raise after this wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._runtime.device import error_word, fence_system, next_epoch, peer_pointer, signal_release, wait_equal
from . import layout as _layout
from .rows import _pad_rows, _rows_compute, _rows_copy, _rows_copy_raw, _rows_store, _slot_pointer, _zero_rows

__all__ = [
    "MODE_RAW",
    "MODE_ROPED",
    "MODE_EXPOSED",
    "MODE_PUSH",
    "MODE_PUSH_LL",
    "MODE_PUSH_LL128",
    "MODE_PUSH_LL12",
    "MODE_PUSH_SN",
    "SLOT_Z",
    "push_region_bytes",
    "header_bytes",
    "direct_kernel",
    "wait_acks_kernel",
    "allgather_rope_kernel",
]

MODE_RAW = 0
MODE_ROPED = 1
MODE_EXPOSED = 2
MODE_PUSH = 3
MODE_PUSH_LL = 4  # CUDA kernel only: push with flags inside the data (csrc/query/direct.cu), T <= the LL bound
MODE_PUSH_LL128 = 5  # CUDA only: push with NCCL's LL128 lines (csrc/query/flag_in_data.cuh), T <= the LL128 bound
MODE_PUSH_LL12 = 6  # CUDA kernel only: MODE_PUSH_LL with 12 data bytes per 16-byte line (csrc/query/flag_in_data.cuh)
MODE_PUSH_SN = 7  # CUDA only, FP8: the sentinel push, no flag bytes (csrc/query/flag_in_data.cuh)
MODE_PDL = 8  # CUDA kernel only: a bit added to the mode: launch with programmatic dependent launch
MODE_EARLY = 16  # CUDA kernel only: a bit added to MODE_PUSH_LL / _SN: load the first inputs before the barrier
MODE_WIDE = 32  # CUDA kernel only: a bit added to MODE_PUSH_SN (interleaved RoPE): 16-byte stores, pairs of words
SLOT_Z = 2
# the same values as constexprs, for use inside @triton.jit (Triton only reads constexpr globals)
_RAW = tl.constexpr(MODE_RAW)
_ROPED = tl.constexpr(MODE_ROPED)
_EXPOSED = tl.constexpr(MODE_EXPOSED)
_PUSH = tl.constexpr(MODE_PUSH)
_SLOT_Z = tl.constexpr(SLOT_Z)


# the exposed buffer's sizes (peerdcp.query.layout), re-exported: callers use them from here
push_region_bytes = _layout.push_region_bytes
header_bytes = _layout.header_bytes


@triton.jit
def _wait_peer(flag, value, err_addr, timeout_ns, max_spins, rank, peer, MECH: tl.constexpr, GPU: tl.constexpr):
    """``wait_equal`` that, in the interpreter, does not wait again once any wait of the object timed out
    (its programs run one after another, so W * NPROG full timeouts would add up)."""
    spins = max_spins
    if not GPU:
        done = tl.load(error_word(err_addr)) != 0
        spins = tl.where(done, 0, max_spins)
    return wait_equal(flag, value, err_addr, timeout_ns, spins, rank, peer, MECH, GPU)


# ------------------------------------------------------------------------------------ direct kernel
@triton.jit
def direct_kernel(
    q_nope,
    q_pe,
    s_nt,
    s_nh,
    s_pt,
    s_ph,
    pos,
    cos_sin,
    max_pos,
    out,
    peer_ptrs,
    epochs,
    last_z,
    err_addr,
    timeout_ns,
    max_spins,
    quant_scale,
    T,
    rank,
    max_tokens,
    data_off,
    slot_bytes,
    W: tl.constexpr,
    H: tl.constexpr,
    HOUT: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    NPROG: tl.constexpr,
    BU: tl.constexpr,
    MODE: tl.constexpr,
    NEOX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    MECH: tl.constexpr,
    GPU: tl.constexpr,
):
    """One call of the consumer-direct gather (grid ``(NPROG,)``; see the module docstring).

    ``q_nope``/``q_pe``: this rank's bf16 shard ``[T, H, *]`` (strides ``s_nt, s_nh`` / ``s_pt, s_ph``,
    last dim contiguous; unused in MODE_EXPOSED). ``pos [T]`` int, ``cos_sin [max_pos, ROPE]`` fp32.
    ``out``: ``[T, HOUT, NOPE + ROPE]`` as uint8 (FP8 codes) or int16 (bf16 bits).
    """
    D: tl.constexpr = NOPE + ROPE
    NB: tl.constexpr = triton.next_power_of_2(NOPE)
    RB: tl.constexpr = triton.next_power_of_2(ROPE)
    HW: tl.constexpr = W * H
    ACK: tl.constexpr = 2 * NPROG * W
    p = tl.program_id(0)
    e = next_epoch(epochs + p)
    par = e % 2
    _pad_rows(out, p, T, HW, HOUT, D, NOPE, NB, RB, BU, NPROG)

    n_units = T * H
    upp = tl.cdiv(n_units, NPROG)
    u0 = p * upp
    u1 = tl.minimum(u0 + upp, n_units)
    if u0 < u1:
        if MODE == _EXPOSED:
            slot = _SLOT_Z
        else:
            slot = par
        me = peer_pointer(peer_ptrs, rank, tl.int8)
        my_flags = me.to(tl.pointer_type(tl.int64))
        my_slot = _slot_pointer(me, data_off, slot, slot_bytes)
        # elements: the raw slot's pe part follows its nope part (int64: max_tokens * H * NOPE passes 2^31 from 65536
        # tokens of 64 x 512, and an int32 product wrapped the pe rows onto the nope rows)
        pe_region = tl.cast(max_tokens, tl.int64) * (H * NOPE)

        # ---- publish: the bytes peers will read, then one system-scope release per peer
        if MODE == _RAW:
            dn = my_slot.to(tl.pointer_type(tl.int16))
            k = u0
            while k < u1:
                u = k + tl.arange(0, BU)
                m = u < u1
                t = (u // H).to(tl.int64)
                h = (u % H).to(tl.int64)
                _rows_copy_raw(
                    q_nope.to(tl.pointer_type(tl.int16)),
                    t * s_nt + h * s_nh,
                    q_pe.to(tl.pointer_type(tl.int16)),
                    t * s_pt + h * s_ph,
                    dn,
                    (t * H + h) * NOPE,
                    dn + pe_region,
                    (t * H + h) * ROPE,
                    m,
                    NOPE,
                    ROPE,
                    NB,
                    RB,
                )
                k += BU
        if (MODE == _ROPED) | (MODE == _PUSH):
            ob = out
            sb = my_slot.to(out.dtype)
            region = tl.cast(max_tokens, tl.int64) * (H * D)  # elements of out dtype per push region
            k = u0
            while k < u1:
                u = k + tl.arange(0, BU)
                m = u < u1
                t = (u // H).to(tl.int64)
                h = (u % H).to(tl.int64)
                pt = tl.load(pos + t, mask=m, other=0).to(tl.int64)
                pt = tl.minimum(tl.maximum(pt, 0), max_pos - 1)
                nb, pb = _rows_compute(
                    q_nope,
                    t * s_nt + h * s_nh,
                    q_pe,
                    t * s_pt + h * s_ph,
                    cos_sin,
                    pt * ROPE,
                    m,
                    quant_scale,
                    BU,
                    NOPE,
                    ROPE,
                    NB,
                    NEOX,
                    OUT_FP8,
                    GPU,
                    "",
                )
                if MODE == _ROPED:
                    _rows_store(sb, (t * H + h) * D, m, nb, pb, NOPE, ROPE, NB)
                else:
                    for i in range(1, W):
                        d = (rank + i) % W
                        dst = _slot_pointer(peer_pointer(peer_ptrs, d, tl.int8), data_off, slot, slot_bytes)
                        _rows_store(dst.to(out.dtype), rank * region + (t * H + h) * D, m, nb, pb, NOPE, ROPE, NB)
                _rows_store(ob, (t * HOUT + rank * H + h) * D, m, nb, pb, NOPE, ROPE, NB)
                k += BU
        if W > 1:
            fence_system(GPU)
            tl.debug_barrier()
            for i in range(1, W):
                d = (rank + i) % W
                flags_d = peer_pointer(peer_ptrs, d, tl.int64)
                tl.atomic_xchg(flags_d + (par * NPROG + p) * W + rank, e, sem="release", scope="sys")

        # ---- own rows (RAW from the caller's tensors, EXPOSED from our own slot Z); overlaps the flags' flight
        if (MODE != _ROPED) & (MODE != _PUSH):
            ob = out
            k = u0
            while k < u1:
                u = k + tl.arange(0, BU)
                m = u < u1
                t = (u // H).to(tl.int64)
                h = (u % H).to(tl.int64)
                pt = tl.load(pos + t, mask=m, other=0).to(tl.int64)
                pt = tl.minimum(tl.maximum(pt, 0), max_pos - 1)
                if MODE == _RAW:
                    nb, pb = _rows_compute(
                        q_nope,
                        t * s_nt + h * s_nh,
                        q_pe,
                        t * s_pt + h * s_ph,
                        cos_sin,
                        pt * ROPE,
                        m,
                        quant_scale,
                        BU,
                        NOPE,
                        ROPE,
                        NB,
                        NEOX,
                        OUT_FP8,
                        GPU,
                        "",
                    )
                else:
                    zb = my_slot.to(tl.pointer_type(tl.bfloat16))
                    nb, pb = _rows_compute(
                        zb,
                        (t * H + h) * NOPE,
                        zb + pe_region,
                        (t * H + h) * ROPE,
                        cos_sin,
                        pt * ROPE,
                        m,
                        quant_scale,
                        BU,
                        NOPE,
                        ROPE,
                        NB,
                        NEOX,
                        OUT_FP8,
                        GPU,
                        "",
                    )
                _rows_store(ob, (t * HOUT + rank * H + h) * D, m, nb, pb, NOPE, ROPE, NB)
                k += BU

        # ---- wait for every peer's twin program (all flags first: the loads below then overlap)
        okmask = 0
        for i in range(1, W):
            s = (rank + i) % W
            ok = _wait_peer(
                my_flags + (par * NPROG + p) * W + s, e, err_addr, timeout_ns, max_spins, rank, s, MECH, GPU
            )
            okmask = okmask | (ok.to(tl.int32) << s)

        # ---- consume: load each peer's rows directly from its slot
        for i in range(1, W):
            s = (rank + i) % W
            ok = ((okmask >> s) & 1) == 1
            src = _slot_pointer(peer_pointer(peer_ptrs, s, tl.int8), data_off, slot, slot_bytes)
            if (MODE == _ROPED) | (MODE == _PUSH):
                ob = out
                if MODE == _PUSH:
                    sb = my_slot.to(out.dtype) + s * (tl.cast(max_tokens, tl.int64) * (H * D))
                else:
                    sb = src.to(out.dtype)
                k = u0
                while k < u1:
                    u = k + tl.arange(0, BU)
                    m = (u < u1) & ok
                    t = (u // H).to(tl.int64)
                    h = (u % H).to(tl.int64)
                    _rows_copy(sb, (t * H + h) * D, ob, (t * HOUT + s * H + h) * D, m, NOPE, ROPE, NB, RB, ".cg")
                    k += BU
            else:
                ob = out
                sb = src.to(tl.pointer_type(tl.bfloat16))
                k = u0
                while k < u1:
                    u = k + tl.arange(0, BU)
                    m = (u < u1) & ok
                    t = (u // H).to(tl.int64)
                    h = (u % H).to(tl.int64)
                    pt = tl.load(pos + t, mask=m, other=0).to(tl.int64)
                    pt = tl.minimum(tl.maximum(pt, 0), max_pos - 1)
                    nb, pb = _rows_compute(
                        sb,
                        (t * H + h) * NOPE,
                        sb + pe_region,
                        (t * H + h) * ROPE,
                        cos_sin,
                        pt * ROPE,
                        m,
                        quant_scale,
                        BU,
                        NOPE,
                        ROPE,
                        NB,
                        NEOX,
                        OUT_FP8,
                        GPU,
                        ".cg",
                    )
                    _rows_store(ob, (t * HOUT + s * H + h) * D, m, nb, pb, NOPE, ROPE, NB)
                    k += BU
                if MODE == _EXPOSED:  # noqa: SIM102 - MODE is a constexpr, ok a runtime value
                    if ok:
                        # release after our reads of s's slot Z (signal_release fences, then the CTA barrier)
                        flags_s = peer_pointer(peer_ptrs, s, tl.int64)
                        signal_release(flags_s + ACK + p * W + rank, e, GPU)
        if MODE == _EXPOSED:
            tl.store(last_z + p, e)


@triton.jit
def wait_acks_kernel(
    peer_ptrs,
    last_z,
    err_addr,
    timeout_ns,
    max_spins,
    rank,
    W: tl.constexpr,
    NPROG: tl.constexpr,
    MECH: tl.constexpr,
    GPU: tl.constexpr,
):
    """Grid ``(NPROG,)``: wait until every peer acknowledged reading our slot Z in program p's last exposed
    call (``ack[p][d] == last_z[p]``); nothing to wait for before the first one (``last_z[p] == 0``)."""
    ACK: tl.constexpr = 2 * NPROG * W
    p = tl.program_id(0)
    ez = tl.load(last_z + p)
    if ez > 0:
        my_flags = peer_pointer(peer_ptrs, rank, tl.int64)
        for i in range(1, W):
            d = (rank + i) % W
            _wait_peer(my_flags + ACK + p * W + d, ez, err_addr, timeout_ns, max_spins, rank, d, MECH, GPU)


# ---------------------------------------------------------------------------------- allgather kernel
@triton.jit
def allgather_rope_kernel(
    gathered,
    pos,
    cos_sin,
    max_pos,
    out,
    quant_scale,
    T,
    W: tl.constexpr,
    H: tl.constexpr,
    HOUT: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    BU: tl.constexpr,
    NEOX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    GPU: tl.constexpr,
):
    """The baseline's one fused pass: ``gathered [W, T, H, NOPE + ROPE]`` bf16 (every rank's packed shard)
    -> ``out [T, HOUT, D]`` (uint8 FP8 codes or int16 bf16 bits), padding heads zeroed.

    Grid: ``cdiv(T * W * H, BU) + cdiv(T * (HOUT - W*H), BU)`` programs of BU rows each.
    """
    D: tl.constexpr = NOPE + ROPE
    NB: tl.constexpr = triton.next_power_of_2(NOPE)
    RB: tl.constexpr = triton.next_power_of_2(ROPE)
    HW: tl.constexpr = W * H
    NPAD: tl.constexpr = HOUT - HW
    p = tl.program_id(0)
    n_rows = T * HW
    n_main = tl.cdiv(n_rows, BU)
    ob = out  # uint8 view (FP8 codes) or int16 view (bf16 bits), typed by the host
    if p < n_main:
        u = p * BU + tl.arange(0, BU)
        m = u < n_rows
        t = (u // HW).to(tl.int64)
        sh = (u % HW).to(tl.int64)  # widened head s*H + h
        s = sh // H
        h = sh % H
        src = ((s * T + t) * H + h) * D
        pt = tl.load(pos + t, mask=m, other=0).to(tl.int64)
        pt = tl.minimum(tl.maximum(pt, 0), max_pos - 1)
        nb, pb = _rows_compute(
            gathered,
            src,
            gathered + NOPE,
            src,
            cos_sin,
            pt * ROPE,
            m,
            quant_scale,
            BU,
            NOPE,
            ROPE,
            NB,
            NEOX,
            OUT_FP8,
            GPU,
            "",
        )
        _rows_store(ob, (t * HOUT + sh) * D, m, nb, pb, NOPE, ROPE, NB)
    else:
        if NPAD > 0:
            j = (p - n_main) * BU + tl.arange(0, BU)
            m = j < T * NPAD
            t = (j // NPAD).to(tl.int64)
            hp = HW + j % NPAD
            _zero_rows(ob, (t * HOUT + hp) * D, m, D, NB, RB, NOPE)
