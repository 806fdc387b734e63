"""Triton kernels of the indexer / Top-K mechanism (GPU and ``TRITON_INTERPRET=1`` alike).

* :func:`_write_kernel` - scatter FP8 index keys + scales into SGLang's page layout (owned tokens only).
* :func:`_logits_kernel` - the FP8 lightning-indexer score over one rank's local pages (DeepGEMM math:
  ``sum_h ReLU(q8 . k8) * w`` in fp32, then ``* k_scale``), -inf past each row's local length.
* :func:`_keys_kernel` - scores -> unique int64 canonical keys (see ``reference.pack_keys``): invalid
  entries become -1, force-included tokens +inf.
* :func:`_publish_kernel` / :func:`_merge_kernel` - the candidate exchange and the exact W-way merge.
* :func:`_owned_kernel` - this rank's local rows of a selection, compacted to the front.

Canonical keys: ``key = ordered(score) << 31 | (2^31 - 1 - gid)`` is >= 1 for every real token and -1 for
"no candidate"; a larger key ranks first, ties are impossible (gids are unique), so every comparison of the
canonical order is one signed int64 compare.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._runtime.device import grid_dependency_sync, next_epoch, peer_pointer, signal_release, wait_equal

__all__ = [
    "_write_kernel",
    "_logits_kernel",
    "_keys_kernel",
    "_publish_kernel",
    "_merge_kernel",
    "_owned_kernel",
]


@triton.jit
def _local_length(L, rank, W, I):
    """Tokens ``g < L`` (int64 ``L``) owned by ``rank``: see ``reference.local_length``."""
    rem = L % (I * W) - rank * I
    rem = tl.minimum(tl.maximum(rem, 0), I)
    return (L // (I * W)) * I + rem


@triton.jit
def _pack_key(s, g):
    """Canonical int64 key of fp32 score ``s`` and int64 global id ``g`` (same shape).

    ``ordered = bits ^ (sign ? 0xFFFFFFFF : 0x80000000)`` as an unsigned 32-bit value, computed in int64
    from the sign-extended bits ``b``: ``-b - 1`` for negative scores, ``b + 2^31`` otherwise (no 32-bit
    literals, whose signedness differs between the compiler and the interpreter).
    """
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == +0.0
    b = s.to(tl.int32, bitcast=True).to(tl.int64)
    o = tl.where(b < 0, -b - 1, b + 2147483647 + 1)
    o = tl.where(s != s, 0, o)  # NaN ranks below -inf (ordered 0x007FFFFF)
    return (o << 31) | (2147483647 - g)


# ------------------------------------------------------------------------------------------ cache write
@triton.jit
def _write_kernel(
    slots,
    k8,
    kscale,
    store8,
    store32,
    N,
    rank,
    W,
    I,
    capacity,
    SHARDED: tl.constexpr,
    PAGE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mi = i < N
    s = tl.load(slots + i, mask=mi, other=-1).to(tl.int64)
    keep = mi & (s >= 0) & (s < capacity)
    if SHARDED:
        keep = keep & (((s // I) % W) == rank)
        row = (s // (I * W)) * I + s % I
    else:
        row = s
    row = tl.where(keep, row, 0)
    page = row // PAGE
    off = row % PAGE
    d = tl.arange(0, D)
    x = tl.load(k8 + i[:, None] * D + d[None, :], mask=keep[:, None])
    tl.store(store8 + page[:, None] * PAGE_BYTES + off[:, None] * D + d[None, :], x, mask=keep[:, None])
    sc = tl.load(kscale + i, mask=keep)
    tl.store(store32 + (page * PAGE_BYTES + PAGE * D) // 4 + off, sc, mask=keep)


# ------------------------------------------------------------------------------------------- scoring
@triton.jit
def _logits_kernel(
    q8,
    q_stride,
    w,
    w_stride,
    seq_lens,
    table,
    table_stride,
    table_cols,
    kv8,
    kv32,
    out,
    out_stride,
    Lmax,
    H,
    num_pages,
    rank,
    W,
    I,
    NPAGE: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    SHARDED: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Program (t, jb): local pages ``jb*NPAGE .. jb*NPAGE+NPAGE-1`` of row t, GROUP pages per dot;
    ``out [T, Lmax]`` fp32.

    Each step scores GROUP pages (GROUP * PAGE tokens) with one dot ``keys [GROUP*PAGE, D] x q^T [D, BLOCK_H]``:
    tokens on the MMA's M side, heads on its N side, so the head sum runs inside a thread's quad rather than
    across the warps holding M (measured 1.3-1.7x faster than ``q x keys^T`` on H200).

    ``HAS_TABLE``: page j of row t is ``table[t, j]`` for ``j < table_cols``; tokens past the table's columns
    score -inf (a row longer than its table reads no page it was not given). The table entries are loaded
    masked by the table's width, not by the row's length, so they do not wait for ``seq_lens``: two dependent
    loads before the dot (length | table entries, then keys), not three.

    ``DOT``: 0 = FP8 x FP8 tensor-core dot (GPU), 1 = fp16 operands (GPU fallback; fp16 holds every e4m3
    value exactly), 2 = fp64 (interpreter: the 128-term FP8 dot is exact in fp64, so the result does not
    depend on the summation order or on the token's position in its page).

    ``PDL``: see ``_runtime.device.grid_dependency_sync`` (launched with ``launch_pdl`` when nonzero).
    """
    t = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    grid_dependency_sync(PDL)  # before any load: q, the table and the newest keys may come from the last kernel
    L = tl.load(seq_lens + t).to(tl.int64)
    if SHARDED:
        nloc = _local_length(L, rank, W, I)
    else:
        nloc = L
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    n = tl.arange(0, GROUP * PAGE)  # token of the step: page n // PAGE of the group, row n % PAGE
    q = tl.load(q8 + t * q_stride + h[:, None] * D + d[None, :], mask=h[:, None] < H, other=0.0)
    wv = tl.load(w + t * w_stride + h, mask=h < H, other=0.0)
    if DOT == 1:
        q = q.to(tl.float16)
    if DOT == 2:
        q = q.to(tl.float32).to(tl.float64)  # (the interpreter cannot cast fp8 -> fp64 directly)
    qt = tl.trans(q)  # [D, BLOCK_H]
    npg_row = (nloc + PAGE - 1) // PAGE
    # A constexpr trip count with masked loads (no memory traffic for pages past the row's end) keeps
    # the loop pipelinable on GPU and runs in the interpreter.
    for i in range(NPAGE // GROUP):
        j = (jb * NPAGE + i * GROUP + n // PAGE).to(tl.int64)  # [GROUP * PAGE] page of each token
        if HAS_TABLE:
            inb = j < table_cols
            page = tl.load(table + t * table_stride + j, mask=inb, other=0).to(tl.int64)
        else:
            inb = j >= 0
            page = j
        live = (j < npg_row) & inb
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # a bad table reads wrong pages, never out of bounds
        base = page * PAGE_BYTES
        row = n % PAGE
        kt = tl.load(kv8 + base[:, None] + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        ks = tl.load(kv32 + (base + PAGE * D) // 4 + row, mask=live, other=0.0)
        if DOT == 1:
            kt = kt.to(tl.float16)
        if DOT == 2:
            s = tl.dot(kt.to(tl.float32).to(tl.float64), qt, out_dtype=tl.float64).to(tl.float32)
        else:
            s = tl.dot(kt, qt, out_dtype=tl.float32)  # [GROUP * PAGE, BLOCK_H]
        r = tl.sum(tl.maximum(s, 0.0) * wv[None, :], axis=1) * ks
        l = j * PAGE + row
        r = tl.where((l < nloc) & inb, r, float("-inf"))
        tl.store(out + t * out_stride + l, r, mask=l < Lmax)


# ------------------------------------------------------------------------------------- candidate keys
@triton.jit
def _keys_kernel(
    logits,
    logits_stride,
    seq_lens,
    keys,
    Lmax,
    rank,
    W,
    I,
    force_first,
    force_last,
    BLOCK: tl.constexpr,
):
    """``keys [T, Lmax]`` int64: canonical key of local row l of row t, or -1 past the local length."""
    t = tl.program_id(0).to(tl.int64)
    l = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = l < Lmax
    L = tl.load(seq_lens + t).to(tl.int64)
    g = (l // I) * W * I + rank * I + l % I
    valid = m & (g < L)
    s = tl.load(logits + t * logits_stride + l, mask=valid, other=0.0)
    s = tl.where((g < force_first) | (g >= L - force_last), float("inf"), s)
    key = tl.where(valid, _pack_key(s, g), -1)
    tl.store(keys + t * Lmax + l, key, mask=m)


# ------------------------------------------------------------------------------- exchange and merge
@triton.jit
def _publish_kernel(
    cand,
    cand_stride,
    cand_len,
    out,
    peer_ptrs,
    state,
    rank,
    MAXR,
    INBOX,
    W: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FILL: tl.constexpr,
    GPU: tl.constexpr,
):
    """Program t: advance row t's epoch, store row t of this rank's candidates (padded to K with -1) into
    every peer's inbox ``[e % 2, rank, t, :]``, release the peer's flag ``[e % 2, rank, t] = e``, and
    (FILL) pre-fill ``out[t, :]`` with -1 for the Triton merge kernel.

    Buffer of every rank (int64 words): flags ``[2, W, MAXR]`` at 0, inbox ``[2, W, MAXR, K]`` at word
    ``INBOX``. ``state`` (local, int64): ``[aborted, epoch of row 0, ..., epoch of row MAXR-1]``. Row t's
    epoch counts the calls that carried row t; this program is the only writer, and the merge kernel
    (later on the stream) reads it. Every rank makes the same calls, so the epochs agree across ranks.
    """
    t = tl.program_id(0).to(tl.int64)
    epoch = next_epoch(state + 1 + t)
    slot = epoch % 2
    for c in range(0, K, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(cand + t * cand_stride + offs, mask=offs < cand_len, other=-1)
        for d in range(W):
            if d != rank:
                dst = peer_pointer(peer_ptrs, d, tl.int64) + INBOX + ((slot * W + rank) * MAXR + t) * K
                tl.store(dst + offs, x, mask=offs < K)
        if FILL:
            tl.store(out + t * K + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < K)
    for d in range(W):
        if d != rank:
            # signal_release fences this program's stores system-wide before the flag (the first fence
            # covers the payload of every destination).
            signal_release(peer_pointer(peer_ptrs, d, tl.int64) + (slot * W + rank) * MAXR + t, epoch, GPU)


@triton.jit
def _merge_kernel(
    out,
    own_addr,
    own_stride,
    own_len,
    lists_addr,
    list_len,
    slot_stride,
    list_stride,
    row_stride,
    flags_addr,
    state,
    err_addr,
    rank,
    MAXR,
    timeout_ns,
    max_spins,
    W: tl.constexpr,
    WP: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    LOGK: tl.constexpr,
    DIRECT: tl.constexpr,
    MECH: tl.constexpr,
    GPU: tl.constexpr,
):
    """Program (t, c, a): place chunk c of candidate list a of row t into ``out [T, K]`` int32 (pre-filled
    with -1: positions no valid candidate reaches stay -1).

    Each list is sorted (keys descending, -1 tail) and keys are unique over all lists, so the output
    position of ``x = list_a[j]`` is ``j + sum_{b != a} #{y in list_b : y > x}`` - one binary search per
    other list (``LOGK`` steps, all lists at once as a ``[WP, BLOCK]`` tile); positions >= K are dropped.
    Exact, no sort, no atomics.

    List b of row t lives at ``lists_addr + (slot*slot_stride + b*list_stride + t*row_stride)*8`` (valid
    entries ``< list_len``). With DIRECT the own list is read from ``own_addr`` (``own_len`` entries) and
    the peers' from this rank's inbox, after a bounded wait for their flags of row t.
    """
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    a = tl.program_id(2)
    ok = tl.full([], 1, tl.int32)
    if DIRECT:
        aborted = tl.load(state)  # an earlier wait of this object timed out: skip the waits
        epoch = tl.load(state + 1 + t)
        slot = epoch % 2
        if aborted != 0:
            ok = tl.full([], 0, tl.int32)
        for s in range(W):
            if s != rank:  # noqa: SIM102 - Triton: scalar runtime conditions, kept nested
                if ok != 0:
                    flag = (flags_addr + ((slot * W + s) * MAXR + t) * 8).to(tl.pointer_type(tl.int64))
                    good = wait_equal(flag, epoch, err_addr, timeout_ns, max_spins, rank, s, MECH, GPU)
                    ok = ok & good.to(tl.int32)
        if ok == 0:
            tl.store(state, 1)
    else:
        slot = 0
    b = tl.arange(0, WP)
    lbase = lists_addr + (slot * slot_stride + b.to(tl.int64) * list_stride + t * row_stride) * 8
    llen = tl.full([WP], 0, tl.int32) + list_len
    if DIRECT:
        lbase = tl.where(b == rank, own_addr + t * own_stride * 8, lbase)
        llen = tl.where(b == rank, own_len, llen)
    abase = tl.sum(tl.where(b == a, lbase, 0), axis=0)
    alen = tl.sum(tl.where(b == a, llen, 0), axis=0)

    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load((abase + offs.to(tl.int64) * 8).to(tl.pointer_type(tl.int64)), mask=(offs < alen) & (ok != 0), other=-1)
    xvalid = x >= 0
    search = (b[:, None] < W) & (b[:, None] != a) & xvalid[None, :]
    lo = tl.zeros([WP, BLOCK], dtype=tl.int32)
    hi = tl.full([WP, BLOCK], K, tl.int32)
    for _ in tl.static_range(LOGK):
        act = search & (lo < hi)
        mid = (lo + hi) >> 1
        ptr = (lbase[:, None] + mid.to(tl.int64) * 8).to(tl.pointer_type(tl.int64))
        v = tl.load(ptr, mask=act & (mid < llen[:, None]), other=-1, cache_modifier=".cg")
        gt = v > x[None, :]
        lo = tl.where(act & gt, mid + 1, lo)
        hi = tl.where(act & (v <= x[None, :]), mid, hi)
    pos = offs + tl.sum(tl.where(search, lo, 0), axis=0)
    gid = 2147483647 - (x & 2147483647)
    tl.store(out + t * K + pos, gid.to(tl.int32), mask=xvalid & (pos < K))


# ----------------------------------------------------------------------------------------- ownership
@triton.jit
def _owned_kernel(ids, ids_stride, rows, counts, rank, W, I, K, BLOCK: tl.constexpr):
    """Row t: local rows of the ids this rank owns, in selection order, then -1; their count."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < K
    g = tl.load(ids + t * ids_stride + offs, mask=m, other=-1).to(tl.int64)
    g0 = tl.maximum(g, 0)
    own = m & (g >= 0) & (((g0 // I) % W) == rank)
    lrow = (g0 // (I * W)) * I + g0 % I
    o = own.to(tl.int32)
    pos = tl.cumsum(o, axis=0) - 1
    cnt = tl.sum(o, axis=0)
    tl.store(rows + t * K + pos, lrow.to(tl.int32), mask=own)
    tl.store(rows + t * K + offs, tl.full([BLOCK], -1, tl.int32), mask=m & (offs >= cnt))
    tl.store(counts + t, cnt)
