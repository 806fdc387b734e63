"""The CUDA C++ Top-K kernels behind a C ABI and ``torch.library`` custom ops: the merge (``csrc/topk/merge.cu``),
the local candidate selection (``csrc/topk/select.cu``) and the indexer scan (``csrc/topk/score.cu``, its own
sm_90a library ``peerdcp_score``).

Each launch entry point takes one parameter block (:class:`TopkMergeParams`, :class:`TopkSelectParams`,
:class:`TopkScoreParams`, mirrored field by field in the ``.cu``) and its size: the C side refuses a block of another
size with cudaErrorInvalidValue, and :func:`load` / :func:`load_score` check the sizes agree. Every launcher is also
a custom op (``peerdcp::topk_merge``, ``peerdcp::topk_select``, ``peerdcp::topk_score``) with a fake implementation,
so ``torch.compile`` traces through it; eager calls of :func:`merge`, :func:`select` and :func:`score` (and CUDA-graph
captures, which record the same launch) fill the block and call the C entry point without the dispatcher. All launch
on the current stream, so they are CUDA-graph capturable. Addresses of peer memory, flags and the error word are raw
ints: their effects are invisible to torch by design.

The merge is local to a rank (it reads this rank's inbox and candidates, waits on this rank's flags), so a rank may
use it or the Triton ``_merge_kernel`` independently of its peers: both place every key at the same position. The
tuning rules that pick the launches' grids are in :mod:`.policy`; this module only launches and queries the
hardware. Built at first use by :func:`peerdcp._runtime.jit.load` (``$PEERDCP_CACHE``; ``python -m
peerdcp._runtime.jit`` prebuilds it).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from .._runtime.device import current_stream_handle
from .._runtime.jit import bind_param_block
from .._runtime.jit import load as load_jit

__all__ = [
    "TopkMergeParams",
    "TopkSelectParams",
    "TopkScoreParams",
    "load",
    "load_score",
    "max_keys",
    "max_select_clusters",
    "Publish",
    "merge",
    "score",
    "score_resident",
    "select",
    "select_max_n",
    "topk_merge",
    "topk_select",
    "topk_score",
]

#: most CTAs per row of the CUDA selection (``kMaxCluster`` in csrc/topk/select.cu: the portable cluster size)
MAX_SELECT_CTAS = 8
#: keys a selection CTA gathers in shared memory (``kBuf`` in csrc/topk/select.cu): rows of at most this many
#: scores skip the threshold estimate
SELECT_BUF = 4096
#: threads of a merge CTA (``kThreads`` in csrc/topk/merge.cu)
THREADS = 512
#: the scan library's instances: the register budget as CTAs per SM the compiler must allow (1 = no budget)
SCORE_MIN_CTAS = (1, 6)
#: most pages per CTA of the CUDA scan (``kMaxPages`` in csrc/topk/score.cu)
SCORE_MAX_PAGES = 64

_i64, _i32, _vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class TopkMergeParams(ctypes.Structure):
    """Mirror of ``TopkMergeParams`` in ``csrc/topk/merge.cu`` (same order, same types); strides in int64 keys."""

    _fields_ = [
        ("out", _vp),  # [T, K] int32 global ids
        ("own", _vp),  # direct: this rank's candidates, row t at own + t * own_stride
        ("lists", _vp),  # list b of row t at lists + slot*slot_stride + b*list_stride + t*row_stride
        ("flags", _vp),  # direct: this rank's flags [2, W, max_rows]
        ("state", _vp),  # direct: [aborted, epoch of row 0, ...]
        ("err", _vp),  # int64[8] error word (pinned host memory)
        ("own_stride", _i64),
        ("slot_stride", _i64),
        ("list_stride", _i64),
        ("row_stride", _i64),
        ("timeout_ns", _i64),
        ("own_len", _i32),
        ("list_len", _i32),
        ("rank", _i32),
        ("W", _i32),
        ("K", _i32),
        ("T", _i32),
        ("max_rows", _i32),
        ("mech", _i32),
        ("direct", _i32),
        ("ctas_per_row", _i32),
        ("place_all", _i32),
        ("pdl", _i32),
    ]


class TopkSelectParams(ctypes.Structure):
    """Mirror of ``TopkSelectParams`` in ``csrc/topk/select.cu`` (same order, same types)."""

    _fields_ = [
        ("out", _vp),  # [T, n] int64 keys
        ("logits", _vp),  # [T, Lmax] fp32, row t at logits + t * logits_stride
        ("seq_lens", _vp),  # [T] int32 or int64 (lens64)
        ("peers", _vp),  # publish: [W] every rank's buffer base (device); null: no publish
        ("state", _vp),  # publish: [1 + max_rows] local epochs
        ("logits_stride", _i64),
        ("force_first", _i64),
        ("force_last", _i64),
        ("inbox", _i64),  # publish: the inbox's word offset in a buffer
        ("lens64", _i32),
        ("Lmax", _i32),
        ("n", _i32),
        ("T", _i32),
        ("rank", _i32),
        ("W", _i32),
        ("I", _i32),
        ("radix_only", _i32),
        ("ctas", _i32),
        ("K", _i32),  # publish: inbox row length
        ("max_rows", _i32),  # publish: inbox rows
    ]


class TopkScoreParams(ctypes.Structure):
    """Mirror of ``TopkScoreParams`` in ``csrc/topk/score.cu`` (same order, same types)."""

    _fields_ = [
        ("q", _vp),  # [T, H, 128] e4m3, row t at q + t * q_stride
        ("w", _vp),  # [T, H] fp32
        ("seq_lens", _vp),  # [T] int32 or int64 (lens64)
        ("table", _vp),  # [T, table_cols] int32 local pages, or null
        ("kv", _vp),  # num_pages x 8448 bytes
        ("out", _vp),  # [T, Lmax] fp32
        ("q_stride", _i64),
        ("w_stride", _i64),
        ("table_stride", _i64),
        ("table_cols", _i64),
        ("num_pages", _i64),
        ("out_stride", _i64),
        ("Lmax", _i64),
        ("lens64", _i32),
        ("T", _i32),
        ("H", _i32),
        ("rank", _i32),
        ("W", _i32),
        ("I", _i32),
        ("sharded", _i32),
        ("npage", _i32),
        ("min_ctas", _i32),
    ]


@functools.cache
def load() -> ctypes.CDLL:
    """Build (once per source hash) and load ``libpeerdcp_topk.so``; checks the parameter layouts. Raises JitError
    without nvcc."""
    lib = load_jit("peerdcp_topk")
    bind_param_block(lib, ("peerdcp_topk_merge",), "peerdcp_topk_merge_params_size", TopkMergeParams)
    bind_param_block(lib, ("peerdcp_topk_select",), "peerdcp_topk_select_params_size", TopkSelectParams)
    lib.peerdcp_topk_merge_max_keys.restype = ctypes.c_int64
    lib.peerdcp_topk_merge_max_keys.argtypes = [ctypes.c_int]
    lib.peerdcp_topk_select_max_clusters.restype = ctypes.c_int
    lib.peerdcp_topk_select_max_clusters.argtypes = [ctypes.c_int]
    lib.peerdcp_topk_select_max_n.restype = ctypes.c_int
    lib.peerdcp_topk_select_max_n.argtypes = []
    return lib


@functools.cache
def load_score() -> ctypes.CDLL:
    """Build (once per source hash) and load ``libpeerdcp_score.so`` (sm_90a); checks the parameter layout. Raises
    JitError without nvcc."""
    lib = load_jit("peerdcp_score")
    bind_param_block(lib, ("peerdcp_topk_score",), "peerdcp_topk_score_params_size", TopkScoreParams)
    lib.peerdcp_topk_score_occupancy.restype = ctypes.c_int
    lib.peerdcp_topk_score_occupancy.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


def _launch(fn, p: ctypes.Structure, device: torch.device, what: str) -> None:
    rc = fn(ctypes.byref(p), ctypes.sizeof(p), current_stream_handle(device))
    if rc != 0:
        raise RuntimeError(f"peerdcp topk {what} launch failed: CUDA error {rc}")


# ------------------------------------------------------------------------------------------- hardware queries
@functools.cache
def max_keys(device: int) -> int:
    """Most int64 keys (W x topk) the CUDA kernel stages per row in shared memory on ``device``; also opts the
    kernel in to that much dynamic shared memory there (once per device, never during a graph capture)."""
    return int(load().peerdcp_topk_merge_max_keys(device))


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


# ------------------------------------------------------------------------------------------------ the merge
def _merge_params(out: torch.Tensor, addrs: list[int], ints: list[int]) -> TopkMergeParams:
    """The block of a merge into ``out``: ``addrs`` (own, lists, flags, state, err), ``ints`` (own_stride,
    slot_stride, list_stride, row_stride, timeout_ns, own_len, list_len, rank, W, K, max_rows, mech, direct,
    ctas_per_row, place_all, pdl) - the op's two lists, in the block's order."""
    p = TopkMergeParams()
    p.out = out.data_ptr()
    p.own, p.lists, p.flags, p.state, p.err = addrs
    (p.own_stride, p.slot_stride, p.list_stride, p.row_stride, p.timeout_ns, p.own_len, p.list_len, p.rank, p.W,
     p.K, p.max_rows, p.mech, p.direct, p.ctas_per_row, p.place_all, p.pdl) = ints  # fmt: skip
    p.T = out.shape[0]
    return p


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
    launch_grid: tuple[int, int],
    pdl: bool = False,
) -> None:
    """Launch the merge of row ``t`` of every list into ``out [T, topk]`` int32 (contiguous) for every t.

    Addresses are raw device addresses (ints); strides are in int64 elements (see the kernel's ``MergeParams``).
    ``launch_grid``: (CTAs per row, place_all), :func:`peerdcp.topk.policy.grid`'s for these rows. ``pdl``: launch
    with programmatic dependent launch (after a :func:`select` with ``publish``, whose kernel lets it start early;
    the merge waits for that kernel's completion before it reads anything). The caller validated shapes; a launch
    error raises RuntimeError.
    """
    addrs = [own, lists, flags, state, err]
    ints = [own_stride, slot_stride, list_stride, row_stride, timeout_ns, own_len, list_len, rank, world_size, topk,
            max_rows, mech, int(direct), *launch_grid, int(pdl)]  # fmt: skip
    if torch.compiler.is_compiling():
        torch.ops.peerdcp.topk_merge(out, addrs, ints)
        return
    _launch(load().peerdcp_topk_merge, _merge_params(out, addrs, ints), out.device, "merge")


@torch.library.custom_op("peerdcp::topk_merge", mutates_args=("out",), device_types="cuda")
def topk_merge(out: torch.Tensor, addrs: list[int], ints: list[int]) -> None:
    """:func:`merge` as an op: ``addrs`` and ``ints`` as :func:`_merge_params` reads them."""
    _launch(load().peerdcp_topk_merge, _merge_params(out, addrs, ints), out.device, "merge")


@topk_merge.register_fake
def _topk_merge_fake(out, addrs, ints) -> None:
    return None


# -------------------------------------------------------------------------------------------- the selection
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


def _select_params(out, logits, seq_lens, peers, state, ints: list[int]) -> TopkSelectParams:
    """The block of a selection: ``ints`` (force_first, force_last, inbox, rank, W, I, radix_only, ctas, K,
    max_rows) as the op passes them; ``peers`` / ``state`` None: no publish."""
    p = TopkSelectParams()
    T, L = logits.shape
    p.out, p.logits, p.seq_lens = out.data_ptr(), logits.data_ptr(), seq_lens.data_ptr()
    p.peers = peers.data_ptr() if peers is not None else None
    p.state = state.data_ptr() if state is not None else None
    p.logits_stride, p.lens64 = logits.stride(0), int(seq_lens.dtype == torch.int64)
    p.Lmax, p.n, p.T = L, out.shape[1], T
    (p.force_first, p.force_last, p.inbox, p.rank, p.W, p.I, p.radix_only, p.ctas, p.K, p.max_rows) = ints
    return p


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
    ctas: int,
    radix_only: bool = False,
    publish: Publish | None = None,
) -> None:
    """This rank's canonical candidates of every row: ``out [T, n]`` int64 (contiguous, n = min(topk, L) <=
    :func:`select_max_n`) = the n largest canonical keys of row t's local scores ``logits [T, L]`` fp32 (rows
    contiguous), descending, -1 past the row's valid keys - what ``candidates.local_keys`` returns, bit for bit.
    ``seq_lens [T]`` int32/int64 global lengths. ``ctas`` CTAs per row (1 to :data:`MAX_SELECT_CTAS`; a
    thread-block cluster when more than one; :func:`peerdcp.topk.policy.select_ctas`), ``radix_only``: skip the
    threshold estimate. With ``publish``, each row is also published to the direct Top-K's peers (the publish
    kernel's work). The caller validated shapes; a launch error raises RuntimeError."""
    peers, state = (publish.peers, publish.state) if publish is not None else (None, None)
    inbox, K, max_rows = (publish.inbox, publish.topk, publish.max_rows) if publish is not None else (0, 0, 0)
    ints = [force_first, force_last, inbox, rank, world_size, interleave, int(radix_only), ctas, K, max_rows]
    if torch.compiler.is_compiling():
        torch.ops.peerdcp.topk_select(out, logits, seq_lens, peers, state, ints)
        return
    _launch(load().peerdcp_topk_select, _select_params(out, logits, seq_lens, peers, state, ints), out.device, "select")


@torch.library.custom_op("peerdcp::topk_select", mutates_args=("out", "state"), device_types="cuda")
def topk_select(
    out: torch.Tensor,
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    peers: torch.Tensor | None,
    state: torch.Tensor | None,
    ints: list[int],
) -> None:
    """:func:`select` as an op: ``ints`` as :func:`_select_params` reads them."""
    _launch(load().peerdcp_topk_select, _select_params(out, logits, seq_lens, peers, state, ints), out.device, "select")


@topk_select.register_fake
def _topk_select_fake(out, logits, seq_lens, peers, state, ints) -> None:
    return None


# --------------------------------------------------------------------------------------------- the indexer scan
def _score_params(out, q_fp8, weights, seq_lens, table, store, ints: list[int]) -> TopkScoreParams:
    """The block of a scan: ``ints`` (num_pages, rank, W, I, sharded, npage, min_ctas) as the op passes them."""
    p = TopkScoreParams()
    p.q, p.q_stride, p.w, p.w_stride = q_fp8.data_ptr(), q_fp8.stride(0), weights.data_ptr(), weights.stride(0)
    p.seq_lens, p.lens64 = seq_lens.data_ptr(), int(seq_lens.dtype == torch.int64)
    if table is not None:
        p.table, p.table_stride, p.table_cols = table.data_ptr(), table.stride(0), table.shape[1]
    p.kv, p.out, p.out_stride, p.Lmax = store.data_ptr(), out.data_ptr(), out.stride(0), out.shape[1]
    p.T, p.H = q_fp8.shape[0], q_fp8.shape[1]
    (p.num_pages, p.rank, p.W, p.I, p.sharded, p.npage, p.min_ctas) = ints
    return p


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
    ints = [num_pages, rank, world_size, interleave, int(sharded), npage, min_ctas]
    if torch.compiler.is_compiling():
        torch.ops.peerdcp.topk_score(out, q_fp8, weights, seq_lens, table, store, ints)
        return
    p = _score_params(out, q_fp8, weights, seq_lens, table, store, ints)
    _launch(load_score().peerdcp_topk_score, p, out.device, "score")


@torch.library.custom_op("peerdcp::topk_score", mutates_args=("out",), device_types="cuda")
def topk_score(
    out: torch.Tensor,
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor | None,
    store: torch.Tensor,
    ints: list[int],
) -> None:
    """:func:`score` as an op: ``ints`` as :func:`_score_params` reads them."""
    p = _score_params(out, q_fp8, weights, seq_lens, table, store, ints)
    _launch(load_score().peerdcp_topk_score, p, out.device, "score")


@topk_score.register_fake
def _topk_score_fake(out, q_fp8, weights, seq_lens, table, store, ints) -> None:
    return None
