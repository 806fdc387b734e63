"""The CUDA C++ Top-K kernels behind ctypes calls on the current stream: the merge (``csrc/topk/merge.cu``), the
local candidate selection (``csrc/topk/select.cu``) and the indexer scan (``csrc/topk/score.cu``, its own sm_90a
library ``peerdcp_score``).

The merge is local to a rank (it reads this rank's inbox and candidates, waits on this rank's flags), so a
rank may use it or the Triton ``_merge_kernel`` independently of its peers: both place every key at the
same position. Launched on the current stream, so it is CUDA-graph capturable. Built at first use by
:func:`peerdcp._runtime.jit.load` (``$PEERDCP_CACHE``; ``python -m peerdcp._runtime.jit`` prebuilds it).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from .._runtime.checks import cuda_index
from .._runtime.device import current_stream_handle, num_sms
from .._runtime.jit import load as load_jit

__all__ = [
    "TUNING",
    "ctas_per_row",
    "grid",
    "load",
    "max_keys",
    "max_select_clusters",
    "Publish",
    "merge",
    "merge_ctas_per_sm",
    "merge_pdl",
    "score",
    "score_resident",
    "select",
    "select_ctas",
    "select_max_n",
]

#: ``cuda_merge_ctas_per_row``: N > 0 forces the cut-off mode with N CTAs per row; ``cuda_merge_place_all_ctas``:
#: N > 0 forces the place-all mode with N CTAs per row, -1 never picks it. Both 0: the rule of :func:`grid`.
#: ``local_select``: "auto" selects local candidates with the CUDA kernel on a GPU where it builds and the row's
#: n = min(topk, L) is at most :func:`select_max_n`; "torch" always takes the Triton keys kernel + ``torch.topk``.
#: ``select_radix_only``: the CUDA selection skips its threshold estimate (tests and diagnosis of the exact path).
#: ``select_ctas``: CTAs per row of the CUDA selection, 1 to :data:`MAX_SELECT_CTAS` (0: the rule of
#: :func:`select_ctas`). ``select_publish``: ``TopK.select``'s direct path publishes each row from the selection
#: kernel (:class:`Publish`) instead of a separate publish kernel after it; ``select_merge_pdl``: its merge kernel
#: then launches with programmatic dependent launch (:func:`merge`'s ``pdl``): True / False, or "auto" - the rule
#: of :func:`merge_pdl` (where both grids fit on the SMs together).
TUNING = {
    "cuda_merge_ctas_per_row": 0,
    "cuda_merge_place_all_ctas": 0,
    "local_select": "auto",
    "select_radix_only": False,
    "select_ctas": 0,
    "select_publish": True,
    "select_merge_pdl": "auto",
}
#: most CTAs per row of the CUDA selection (``kMaxCluster`` in csrc/topk/select.cu: the portable cluster size)
MAX_SELECT_CTAS = 8
#: keys a selection CTA gathers in shared memory (``kBuf`` in csrc/topk/select.cu): rows of at most this many
#: scores skip the threshold estimate
SELECT_BUF = 4096
#: scores a cluster must spare each of its CTAs (row length x (1 - 1/C)) before :func:`select_ctas` takes it
CLUSTER_MIN_SPARED = 8192
#: most CTAs per row of the cut-off mode: every CTA stages all W lists of its row and finds the W cut-offs itself,
#: so past a few CTAs the shared placement work no longer pays for the repeated staging
MAX_CTAS_PER_ROW = 4
#: threads of a merge CTA (``kThreads`` in csrc/topk/merge.cu)
THREADS = 512

_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once per source hash) and load ``libpeerdcp_topk.so``; raises JitError without nvcc."""
    lib = load_jit("peerdcp_topk")
    lib.peerdcp_topk_merge.restype = ctypes.c_int
    lib.peerdcp_topk_merge.argtypes = [
        _vp,  # out
        _vp,
        _i64,
        _i32,  # own, own_stride, own_len
        _vp,
        _i64,
        _i64,
        _i64,
        _i32,  # lists, slot_stride, list_stride, row_stride, list_len
        _vp,
        _vp,
        _vp,  # flags, state, err
        _i64,  # timeout_ns
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,
        _i32,  # rank, W, K, T, max_rows, mech, direct
        _i32,  # ctas_per_row
        _i32,  # place_all
        _i32,  # pdl
        _vp,  # stream
    ]
    lib.peerdcp_topk_merge_max_keys.restype = ctypes.c_int64
    lib.peerdcp_topk_merge_max_keys.argtypes = [ctypes.c_int]
    lib.peerdcp_topk_select.restype = ctypes.c_int
    lib.peerdcp_topk_select.argtypes = [
        _vp, _vp, _i64, _vp, _i32, _i32, _i32, _i32, _i32, _i32, _i32, _i64, _i64, _i32, _i32,
        _vp, _vp, _i64, _i32, _i32,  # publish: peers, state, inbox word, K, max_rows (peers null: none)
        _vp,  # stream
    ]  # fmt: skip
    lib.peerdcp_topk_select_max_clusters.restype = ctypes.c_int
    lib.peerdcp_topk_select_max_clusters.argtypes = [ctypes.c_int]
    lib.peerdcp_topk_select_max_n.restype = ctypes.c_int
    lib.peerdcp_topk_select_max_n.argtypes = []
    return lib


@functools.cache
def max_keys(device: int) -> int:
    """Most int64 keys (W x topk) the CUDA kernel stages per row in shared memory on ``device``; also opts the
    kernel in to that much dynamic shared memory there (once per device, never during a graph capture)."""
    return int(load().peerdcp_topk_merge_max_keys(device))


def ctas_per_row(rows: int, device: int) -> int:
    """CTAs per row of the cut-off mode for a ``rows``-row merge on ``device``: as many as keep one wave of CTAs
    (SMs // rows), 1 to :data:`MAX_CTAS_PER_ROW`."""
    return max(1, min(MAX_CTAS_PER_ROW, num_sms(device) // max(rows, 1)))


def merge_ctas_per_sm(world_size: int, topk: int, device: int) -> int:
    """Merge CTAs an SM of ``device`` holds at once for ``world_size`` lists of ``topk`` keys: two, or one when a
    CTA's W·k staged keys take over half of the shared memory the kernel may use."""
    return max(1, min(2, max_keys(device) // (world_size * topk)))


def grid(rows: int, world_size: int, topk: int, device: int) -> tuple[int, int]:
    """(CTAs per row, place_all) of the CUDA merge of ``rows`` rows of ``world_size`` lists of ``topk`` keys.

    Place-all mode (1) when the CTAs that fit at once, up to two per SM (one when a CTA's W·k keys take over half
    an SM's shared memory), can give every thread at most two of the row's W·k keys: N = min(ceil(W·k /
    THREADS), fit // rows) CTAs per row, each staging the lists and placing its share of keys, no cut-off search.
    Otherwise the cut-off mode (0) with :func:`ctas_per_row` CTAs. Measured on one H200, cut-off -> place-all
    (``scripts/diag/merge_scaling.py``, local lists, k = 2048): one row 7.1 -> 4.0 µs at W = 2, 12.5 -> 6.3 at
    W = 4, 22.3 -> 10.8 at W = 8; W = 2 × 64 rows 8.3 -> 6.2 (two CTAs per SM); at four keys per thread in one
    wave (W = 8, 16 rows) and at 256 CTAs of eight keys per thread (W = 4, 128 rows) the cut-off mode wins.
    """
    forced, forced_pa = int(TUNING["cuda_merge_ctas_per_row"]), int(TUNING["cuda_merge_place_all_ctas"])
    if forced > 0:
        return forced, 0
    if forced_pa > 0:
        return forced_pa, 1
    full = -(-world_size * topk // THREADS)  # CTAs that give every thread one key
    avail = merge_ctas_per_sm(world_size, topk, device) * num_sms(device) // max(rows, 1)
    if forced_pa == 0 and 2 * avail >= full:
        return max(1, min(full, avail)), 1
    return ctas_per_row(rows, device), 0


def merge_pdl(
    rows: int, world_size: int, topk: int, device: int, length: int, *, launch_grid: tuple[int, int] | None = None
) -> bool:
    """Whether ``TopK.select``'s merge kernel launches with PDL after its publishing selection of ``rows`` rows of
    ``length`` local scores: ``TUNING["select_merge_pdl"]`` when it is a bool; "auto": when the selection's and the
    merge's CTAs fit on the SMs together. The merge's CTAs then start on SMs of their own while the selection runs,
    and its launch no longer follows the selection's end; past that, early merge CTAs wait where later ones would
    run. A selection CTA takes a whole SM (1024 threads at 64 registers). The merge's CTAs (:func:`grid`) count
    one per SM after clustered selections (:func:`select_ctas` > 1), and by the SMs they fill
    (:func:`merge_ctas_per_sm` to an SM) after one-CTA selections.

    Measured by one-GPU emulation of rank 0's exchange (``scripts/diag/publish_fused.py --exchange``, in git history;
    k = 2048;
    bench/RESULTS.md, History): with PDL 0.3-1.1 µs faster inside the rule, up to 6 µs slower well past it.
    One-CTA rows (<= 8K scores) gain 0.4-0.7 µs up to 26 rows at W = 2 and 14 at W = 4 and not past: the rule's
    boundaries with merge CTAs two to an SM (counting one to an SM would stop at 14 and 7 rows). Clustered
    rows lose inside the two-to-an-SM count (W = 2 x 10-24 rows of 16K: 0.2-1.9 µs), hence one to an SM there.
    At W = 8 (one merge CTA per SM; the cut-off mode from 10 rows) it takes PDL at 1-4 and 10-16 one-CTA rows:
    5-12 rows gained 0.3-0.75 µs, 16 rows of 2K lost 0.2 - the rule leaves ~0.5 µs at 5-8 rows there.
    Two GPUs have not run it.
    ``launch_grid``: the merge's :func:`grid`, when the caller has it already (~1.7 µs of Python)."""
    forced = TUNING["select_merge_pdl"]
    if isinstance(forced, bool):
        return forced
    ctas = select_ctas(rows, device, length)
    per_row, _ = launch_grid if launch_grid is not None else grid(rows, world_size, topk, device)
    per_sm = merge_ctas_per_sm(world_size, topk, device) if ctas == 1 else 1  # merge CTAs counted to an SM
    return rows * ctas + -(-rows * per_row // per_sm) <= num_sms(device)


def merge(
    out: torch.Tensor,
    *,
    own: int = 0,
    own_stride: int = 0,
    own_len: int = 0,
    lists: int,
    slot_stride: int,
    list_stride: int,
    row_stride: int,
    list_len: int,
    flags: int = 0,
    state: int = 0,
    err: int = 0,
    timeout_ns: int = 0,
    rank: int = 0,
    world_size: int,
    topk: int,
    max_rows: int = 0,
    mech: int = 0,
    direct: bool,
    pdl: bool = False,
    launch_grid: tuple[int, int] | None = None,
) -> None:
    """Launch the merge of row ``t`` of every list into ``out [T, topk]`` int32 (contiguous) for every t.

    Addresses are raw device addresses (ints); strides are in int64 elements (see the kernel's
    ``MergeParams``). ``pdl``: launch with programmatic dependent launch (after a :func:`select` with
    ``publish``, whose kernel lets it start early; the merge waits for that kernel's completion before it reads
    anything). ``launch_grid``: :func:`grid`'s (CTAs per row, place_all) for these rows when the caller has it
    already. The caller validated shapes; a launch error raises RuntimeError.
    """
    T = out.shape[0]
    stream = current_stream_handle(out.device)
    if launch_grid is None:
        launch_grid = grid(T, world_size, topk, cuda_index(out.device))
    rc = load().peerdcp_topk_merge(
        out.data_ptr(),
        own,
        own_stride,
        own_len,
        lists,
        slot_stride,
        list_stride,
        row_stride,
        list_len,
        flags,
        state,
        err,
        timeout_ns,
        rank,
        world_size,
        topk,
        T,
        max_rows,
        mech,
        int(direct),
        *launch_grid,
        int(pdl),
        stream,
    )
    if rc != 0:
        raise RuntimeError(f"peerdcp topk merge launch failed: CUDA error {rc}")


@functools.cache
def select_max_n() -> int:
    """Largest n = min(topk, L) :func:`select` handles (its gather holds 4096 keys, of which the sort keeps the n
    largest; a radix level may stop with up to 4096 - n + 1 candidates)."""
    return int(load().peerdcp_topk_select_max_n())


@functools.cache
def max_select_clusters(ctas: int, device: int) -> int:
    """Most clusters of ``ctas`` selection CTAs resident at once on ``device`` (CUDA's occupancy query; -1 when it
    fails). A cluster must fit in one GPC, so this is below SMs / ctas: e.g. 32 rows x 4 CTAs (128 of 132 SMs) ran
    as two waves on H200, 1.4x slower than one CTA per row."""
    with torch.cuda.device(device):
        return int(load().peerdcp_topk_select_max_clusters(ctas))


def select_ctas(rows: int, device: int, length: int | None = None) -> int:
    """CTAs per row of the CUDA selection of ``rows`` rows of ``length`` scores on ``device``:
    ``TUNING["select_ctas"]`` when set; else the largest C of 8, 4, 2 whose ``rows`` clusters are all resident at
    once (:func:`max_select_clusters`) if it spares each CTA more than :data:`CLUSTER_MIN_SPARED` scores
    (``length`` · (1 - 1/C)), else 1.
    One CTA of 1024 threads per row leaves the other SMs idle at few rows; a cluster of C splits the row's reads
    C ways, but its steps (the count and histogram exchanges, the funnel into CTA 0, which then sorts alone) cost
    about as much as one CTA's gather of ~8K scores (``scripts/diag/select_ctas_sweep.py`` (in git history),
    8-64 rows: at 8K scores one CTA 11.8-12.0 µs, clusters of 2 / 4 / 8 13.3-13.6 / 12.8-13.0 / 12.8; at 16K one CTA
    13.4-13.8, C = 2 13.6-14.0, C = 4 13.2-13.4, C = 8 12.95; at 32K every cluster faster). A smaller C spares fewer
    scores, so when the largest resident C does not pay, none does. Rows of at most :data:`SELECT_BUF` scores
    (gathered whole by index) never take a cluster. ``length`` None: the largest resident C."""
    forced = int(TUNING["select_ctas"])
    if forced:
        return max(1, min(MAX_SELECT_CTAS, forced))
    for c in (8, 4, 2):
        if rows <= max_select_clusters(c, device):
            return c if length is None or length * (c - 1) > CLUSTER_MIN_SPARED * c else 1
    return 1


class Publish(NamedTuple):
    """The direct Top-K's publish step, run by :func:`select` after each row (``selector.py`` has the protocol):
    ``peers`` ``int64 [W]`` every rank's buffer base address (device tensor), ``state`` ``int64 [1 + max_rows]``
    (``[aborted, epoch of row 0, ...]``, local), ``inbox`` the inbox's word offset in a buffer, ``topk`` its row
    length K (>= the selection's n), ``max_rows`` its rows (>= T)."""

    peers: torch.Tensor
    state: torch.Tensor
    inbox: int
    topk: int
    max_rows: int


def select(
    out: torch.Tensor,
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    interleave: int,
    force_first: int,
    force_last: int,
    publish: Publish | None = None,
) -> None:
    """This rank's canonical candidates of every row: ``out [T, n]`` int64 (contiguous, n = min(topk, L) <=
    :func:`select_max_n`) = the n largest canonical keys of row t's local scores ``logits [T, L]`` fp32 (rows
    contiguous), descending, -1 past the row's valid keys - what ``selector._local_keys`` returns, bit for bit.
    ``seq_lens [T]`` int32/int64 global lengths. :func:`select_ctas` CTAs per row (a thread-block cluster when more
    than one). With ``publish``, each row is also published to the direct Top-K's peers (the publish kernel's work).
    The caller validated shapes; a launch error raises RuntimeError."""
    T, L = logits.shape
    stream = current_stream_handle(out.device)
    dev = cuda_index(out.device)
    rc = load().peerdcp_topk_select(
        out.data_ptr(),
        logits.data_ptr(),
        logits.stride(0),
        seq_lens.data_ptr(),
        int(seq_lens.dtype == torch.int64),
        L,
        out.shape[1],
        T,
        rank,
        world_size,
        interleave,
        force_first,
        force_last,
        int(bool(TUNING["select_radix_only"])),
        select_ctas(T, dev, L),
        *(
            (None, None, 0, 0, 0)
            if publish is None
            else (publish.peers.data_ptr(), publish.state.data_ptr(), publish.inbox, publish.topk, publish.max_rows)
        ),
        stream,
    )
    if rc != 0:
        raise RuntimeError(f"peerdcp topk select launch failed: CUDA error {rc}")


# ------------------------------------------------------------------------------------------- indexer scan
#: the scan library's instances: the register budget as CTAs per SM the compiler must allow (1 = no budget)
SCORE_MIN_CTAS = (1, 6)
#: most pages per CTA of the CUDA scan (``kMaxPages`` in csrc/topk/score.cu)
SCORE_MAX_PAGES = 64


@functools.cache
def load_score() -> ctypes.CDLL:
    """Build (once per source hash) and load ``libpeerdcp_score.so`` (sm_90a); raises JitError without nvcc."""
    lib = load_jit("peerdcp_score")
    lib.peerdcp_topk_score.restype = ctypes.c_int
    lib.peerdcp_topk_score.argtypes = [
        _vp, _i64, _vp, _i64,  # q, q_stride, w, w_stride
        _vp, _i32, _vp, _i64, _i64,  # seq_lens, lens64, table, table_stride, table_cols
        _vp, _i64, _vp, _i64, _i64,  # kv, num_pages, out, out_stride, Lmax
        _i32, _i32, _i32, _i32, _i32, _i32, _i32, _i32,  # T, H, rank, W, I, sharded, npage, min_ctas
        _vp,  # stream
    ]  # fmt: skip
    lib.peerdcp_topk_score_occupancy.restype = ctypes.c_int
    lib.peerdcp_topk_score_occupancy.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


@functools.cache
def score_resident(device: int, min_ctas: int, heads: int) -> int:
    """Resident CTAs per SM of the CUDA scan instance ``min_ctas`` (of :data:`SCORE_MIN_CTAS`) for ``heads`` query
    heads on ``device``; 0 where the device is not a Hopper GPU (the library is sm_90a code; nothing is built)."""
    if min_ctas not in SCORE_MIN_CTAS:
        raise ValueError(f"peerdcp topk score: no instance for {min_ctas} CTAs per SM; have {SCORE_MIN_CTAS}")
    if torch.cuda.get_device_capability(device) != (9, 0):
        return 0
    with torch.cuda.device(device):
        n = int(load_score().peerdcp_topk_score_occupancy(min_ctas, int(heads <= 32)))
    if n < 1:
        raise RuntimeError(f"peerdcp topk score: no occupancy for {min_ctas} CTAs per SM, {heads} heads")
    return n


def score(
    out: torch.Tensor,
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor | None,
    store: torch.Tensor,
    *,
    num_pages: int,
    rank: int,
    world_size: int,
    interleave: int,
    sharded: bool,
    npage: int,
    min_ctas: int,
) -> None:
    """The indexer scan into ``out [T, Lmax]`` fp32 (rows contiguous): ``q_fp8 [T, H <= 64, 128]`` e4m3 (rows
    ``[H, 128]`` contiguous, 16-byte aligned), ``weights [T, H]`` fp32, ``seq_lens [T]`` int32/int64 global lengths,
    ``table [T, cols]`` int32 local pages or None, ``store`` the cache's pages (``num_pages`` x 8448 bytes, 16-byte
    aligned). ``npage`` pages per CTA (1 to :data:`SCORE_MAX_PAGES`), ``min_ctas`` of :data:`SCORE_MIN_CTAS`. The
    caller validated shapes; a launch error raises RuntimeError."""
    T, H = q_fp8.shape[0], q_fp8.shape[1]
    rc = load_score().peerdcp_topk_score(
        q_fp8.data_ptr(),
        q_fp8.stride(0),
        weights.data_ptr(),
        weights.stride(0),
        seq_lens.data_ptr(),
        int(seq_lens.dtype == torch.int64),
        table.data_ptr() if table is not None else None,
        table.stride(0) if table is not None else 0,
        table.shape[1] if table is not None else 0,
        store.data_ptr(),
        num_pages,
        out.data_ptr(),
        out.stride(0),
        out.shape[1],
        T,
        H,
        rank,
        world_size,
        interleave,
        int(sharded),
        npage,
        min_ctas,
        current_stream_handle(out.device),
    )
    if rc != 0:
        raise RuntimeError(f"peerdcp topk score launch failed: CUDA error {rc}")
