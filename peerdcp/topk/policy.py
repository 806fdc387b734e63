"""Every tuning rule of the Indexer / Top-K mechanism: one immutable :class:`TopKPolicy`, and the rules that apply it.

:data:`DEFAULT_POLICY` holds the defaults. :class:`~peerdcp.topk.TopK` takes ``policy=`` at construction,
:func:`~peerdcp.topk.indexer_logits` and :func:`~peerdcp.topk.canonical_topk` per call; None means
:func:`default_policy` (the default with ``PEERDCP_INDEXER_UPCAST`` applied, read then, not at import). To
experiment, pass ``dataclasses.replace(DEFAULT_POLICY, field=...)`` (the merge and the selection are local to a
rank, so ranks may differ; every rank of one scan must pass the same scan fields to get the same scores).

The rules below take the call's shape (rows, scores per row, world size, device) and the policy; the hardware
queries they need (SMs, shared memory, resident clusters or CTAs) come from :mod:`.ops`.

Figures: one H200 (132 SMs) unless said; the scan's are DeepSeek-V3.2's indexer (64 heads x 128, FP8), µs
replicated / owner-sharded, 2 x H200 or a one-GPU emulation of W = 2 (the tables: bench/RESULTS.md, Top-K).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from .._runtime.device import num_sms
from . import ops

__all__ = [
    "TopKPolicy",
    "DEFAULT_POLICY",
    "default_policy",
    "ctas_per_row",
    "merge_ctas_per_sm",
    "grid",
    "merge_pdl",
    "select_ctas",
    "scan_npage",
    "cuda_scan_npage",
    "cuda_scan_wanted",
]


@dataclass(frozen=True)
class TopKPolicy:
    """Tuning of the merge, the local selection and the indexer scan; the defaults are the library's."""

    # ---- the CUDA merge (csrc/topk/merge.cu): its grid (:func:`grid`)
    # N > 0 forces the cut-off mode with N CTAs per row (diagnosis: scripts/diag/merge_scaling.py); 0: :func:`grid`.
    cuda_merge_ctas_per_row: int = 0
    # N > 0 forces the place-all mode with N CTAs per row, -1 never picks it; 0: :func:`grid`.
    cuda_merge_place_all_ctas: int = 0
    # most CTAs per row of the cut-off mode: each stages all W lists and finds the W cut-offs itself, so past a few
    # CTAs the shared placement no longer pays for the repeated staging.
    max_merge_ctas_per_row: int = 4

    # ---- the local candidate selection (csrc/topk/select.cu)
    # "auto": the CUDA selection on a GPU where it builds and n = min(topk, L) <= ops.select_max_n(); "torch":
    # always the Triton keys kernel + torch.topk (the exact twin; bench.topk --local compares them).
    local_select: str = "auto"
    # the CUDA selection skips its threshold estimate (tests and diagnosis of the exact radix path).
    select_radix_only: bool = False
    # CTAs per row of the CUDA selection, 1 to ops.MAX_SELECT_CTAS (0: :func:`select_ctas`).
    select_ctas: int = 0
    # scores a cluster must spare each of its CTAs (row length x (1 - 1/C)) before :func:`select_ctas` takes it: a
    # cluster's exchanges cost about one CTA's gather of ~8K scores (8K: one CTA 11.8-12.0 µs, C = 2/4/8 13.3-13.6 /
    # 12.8-13.0 / 12.8; 16K: one CTA 13.4-13.8, C = 8 12.95; 32K: every cluster faster; 8-64 rows).
    cluster_min_spared: int = 8192
    # TopK.select's direct path publishes each row from the selection kernel instead of a separate publish
    # kernel after it (one launch less).
    select_publish: bool = True
    # its merge kernel then launches with programmatic dependent launch: True / False, or "auto" - :func:`merge_pdl`
    # (0.3-1.1 µs faster inside the rule, up to 6 µs slower well past it; one-GPU emulation, k = 2048).
    select_merge_pdl: bool | str = "auto"

    # ---- the indexer scan (indexer_logits): which kernel
    # "triton" (kernels._logits_kernel), "cuda" (csrc/topk/score.cu: Hopper, 64-token pages of 128-byte keys, <= 64
    # heads, 16-byte aligned query rows; else Triton) or "auto": the CUDA scan from cuda_scan_min_rows rows on.
    scan_backend: str = "auto"
    # (heads <= 32, more heads) or one int for both: rows from which "auto" takes the CUDA scan. Rows and heads only,
    # so both layouts of the same rows agree bit for bit. Triton -> CUDA: 8 x 32K 13.24 / 8.17 -> 12.29 / 8.07, GLM-5
    # (32 heads) 128 x 128K 605.8 / 312.9 -> 543.0 / 275.5; 64 heads, 1-2 rows slower at 32K, 3 rows 6.96 -> 6.54.
    cuda_scan_min_rows: int | tuple[int, int] = (1, 3)
    # the CUDA scan's register budget as CTAs per SM (an instance of ops.SCORE_MIN_CTAS; 8 spills and runs 2x slower).
    cuda_scan_min_ctas: int = 6
    # pages per CTA of the CUDA scan (0: :func:`cuda_scan_npage`; fixed 2-10 measured slower at 8-64 rows).
    cuda_scan_npage: int = 0
    # a CUDA scan CTA's start (table entries, query tile, first page's latency) in pages, for :func:`cuda_scan_npage`.
    cuda_scan_cta_pages: float = 2.0
    # ---- the Triton scan's work split
    # pages per dot, the same for every call so a token's score never depends on the call's size. 1: 3.40 / 2.89 at
    # 1 x 32K, 677 / 347 at 128 x 128K; 2 is 7-15 % faster up to 8 rows and 5-25 % slower from 32 rows.
    scan_group: int = 1
    # pages per program (0: :func:`scan_npage`).
    scan_npage: int = 0
    # the page loop's pipeline depth (num_stages; 0 = Triton's, 3 on Hopper): 2 is faster or equal everywhere
    # (46.8 / 27.4 -> 46.0 / 25.2 at 32 x 32K, 707 / 344 -> 642 / 329 at 128 x 128K).
    scan_stages: int = 2
    # pages-per-program candidates of :func:`scan_npage`; against {1, 4, 16}: 8 x 32K 16.25 / 9.66 -> 13.32 / 8.21,
    # 32 x 32K 46.13 / 25.24 -> 43.59 / 24.82 (4 pages at ~31 programs per SM: 46.3 vs 43.2 for 2, not a candidate).
    scan_npages: tuple[int, ...] = (1, 2, 8, 16)
    # programs per SM the largest multi-page candidate must leave (fewer leave SMs idle at the end).
    scan_min_programs_per_sm: float = 30
    # ... the smallest multi-page one (396 programs on H200): 2 pages beat 1 from 512 programs on (1 x 128K sharded
    # 4.39 vs 4.77) and lose at 256 and fewer (2 x 32K sharded 3.60 vs 3.49).
    scan_min_programs_per_sm_small: float = 3
    # candidates of the mid-size wave-fill rule (empty: off): 7 and 9 give 8 x 128K sharded 23.48 -> 22.57 (9 pages:
    # one wave of 912 programs instead of 10), 16 x 32K replicated 23.29 -> 22.36.
    scan_wave_npages: tuple[int, ...] = (2, 5, 6, 7, 8, 9, 10, 12)
    # resident programs per SM of the FP8 scan with scan_maxnreg 64 (7 uncapped: 72 registers).
    scan_resident_per_sm: int = 8
    # programmatic dependent launch of the Triton scan: 0 off, 1 wait for the previous kernel inside the kernel, 2
    # also let the next PDL kernel launch once every program started (0.2 µs at one wave: too little for a default).
    scan_pdl: int = 0
    # register cap of the FP8 scan with a 64-head tile (Triton's maxnreg; 0 = none): 8 programs per SM instead of 7,
    # 2-5 % faster at 32-128 rows (32 x 32K 41.26 / 23.46 -> 40.62 / 22.49), worst 128 x 128K replicated +1.6 %.
    scan_maxnreg: int = 64
    # force the fp16-upcast scan (tests, diagnosis; exact too); default_policy sets it from PEERDCP_INDEXER_UPCAST=1.
    scan_upcast: bool = False


#: the library's defaults (no environment applied)
DEFAULT_POLICY = TopKPolicy()


@functools.lru_cache(maxsize=4)
def _with_env(upcast: str | None) -> TopKPolicy:
    return dataclasses.replace(DEFAULT_POLICY, scan_upcast=True) if upcast == "1" else DEFAULT_POLICY


def default_policy() -> TopKPolicy:
    """:data:`DEFAULT_POLICY` with ``PEERDCP_INDEXER_UPCAST=1`` applied (read now: per construction or call)."""
    return _with_env(os.environ.get("PEERDCP_INDEXER_UPCAST"))


def _p(policy: TopKPolicy | None) -> TopKPolicy:
    return DEFAULT_POLICY if policy is None else policy


# ------------------------------------------------------------------------------------------------ the merge
def ctas_per_row(rows: int, device: int, *, policy: TopKPolicy | None = None) -> int:
    """CTAs per row of the cut-off mode for a ``rows``-row merge on ``device``: as many as keep one wave of CTAs
    (SMs // rows), 1 to ``max_merge_ctas_per_row``."""
    return max(1, min(_p(policy).max_merge_ctas_per_row, num_sms(device) // max(rows, 1)))


def merge_ctas_per_sm(world_size: int, topk: int, device: int) -> int:
    """Merge CTAs an SM of ``device`` holds at once for ``world_size`` lists of ``topk`` keys: two, or one when a
    CTA's W·k staged keys take over half of the shared memory the kernel may use."""
    return max(1, min(2, ops.max_keys(device) // (world_size * topk)))


def grid(rows: int, world_size: int, topk: int, device: int, *, policy: TopKPolicy | None = None) -> tuple[int, int]:
    """(CTAs per row, place_all) of the CUDA merge of ``rows`` rows of ``world_size`` lists of ``topk`` keys.

    Place-all mode (1) when the CTAs that fit at once, up to two per SM (one when a CTA's W·k keys take over half
    an SM's shared memory), can give every thread at most two of the row's W·k keys: N = min(ceil(W·k /
    THREADS), fit // rows) CTAs per row, each staging the lists and placing its share of keys, no cut-off search.
    Otherwise the cut-off mode (0) with :func:`ctas_per_row` CTAs. Measured on one H200, cut-off -> place-all
    (``scripts/diag/merge_scaling.py``, local lists, k = 2048): one row 7.1 -> 4.0 µs at W = 2, 12.5 -> 6.3 at
    W = 4, 22.3 -> 10.8 at W = 8; W = 2 × 64 rows 8.3 -> 6.2 (two CTAs per SM); at four keys per thread in one
    wave (W = 8, 16 rows) and at 256 CTAs of eight keys per thread (W = 4, 128 rows) the cut-off mode wins.
    """
    p = _p(policy)
    forced, forced_pa = int(p.cuda_merge_ctas_per_row), int(p.cuda_merge_place_all_ctas)
    if forced > 0:
        return forced, 0
    if forced_pa > 0:
        return forced_pa, 1
    full = -(-world_size * topk // ops.THREADS)  # CTAs that give every thread one key
    avail = merge_ctas_per_sm(world_size, topk, device) * num_sms(device) // max(rows, 1)
    if forced_pa == 0 and 2 * avail >= full:
        return max(1, min(full, avail)), 1
    return ctas_per_row(rows, device, policy=p), 0


def merge_pdl(
    rows: int,
    world_size: int,
    topk: int,
    device: int,
    length: int,
    *,
    launch_grid: tuple[int, int] | None = None,
    policy: TopKPolicy | None = None,
) -> bool:
    """Whether ``TopK.select``'s merge kernel launches with PDL after its publishing selection of ``rows`` rows of
    ``length`` local scores: ``select_merge_pdl`` when it is a bool; "auto": when the selection's and the merge's
    CTAs fit on the SMs together. The merge's CTAs then start on SMs of their own while the selection runs, and its
    launch no longer follows the selection's end; past that, early merge CTAs wait where later ones would run. A
    selection CTA takes a whole SM (1024 threads at 64 registers). The merge's CTAs (:func:`grid`) count one per SM
    after clustered selections (:func:`select_ctas` > 1), and by the SMs they fill (:func:`merge_ctas_per_sm` to
    an SM) after one-CTA selections.

    Measured by one-GPU emulation of rank 0's exchange (k = 2048; bench/RESULTS.md, History): with PDL 0.3-1.1 µs
    faster inside the rule, up to 6 µs slower well past it. One-CTA rows (<= 8K scores) gain 0.4-0.7 µs up to 26
    rows at W = 2 and 14 at W = 4 and not past: the rule's boundaries with merge CTAs two to an SM (counting one to
    an SM would stop at 14 and 7 rows). Clustered rows lose inside the two-to-an-SM count (W = 2 x 10-24 rows of
    16K: 0.2-1.9 µs), hence one to an SM there. At W = 8 (one merge CTA per SM; the cut-off mode from 10 rows) it
    takes PDL at 1-4 and 10-16 one-CTA rows: 5-12 rows gained 0.3-0.75 µs, 16 rows of 2K lost 0.2 - the rule leaves
    ~0.5 µs at 5-8 rows there. Two GPUs have not run it.
    ``launch_grid``: the merge's :func:`grid`, when the caller has it already (~1.7 µs of Python)."""
    p = _p(policy)
    forced = p.select_merge_pdl
    if isinstance(forced, bool):
        return forced
    ctas = select_ctas(rows, device, length, policy=p)
    per_row, _ = launch_grid if launch_grid is not None else grid(rows, world_size, topk, device, policy=p)
    per_sm = merge_ctas_per_sm(world_size, topk, device) if ctas == 1 else 1  # merge CTAs counted to an SM
    return rows * ctas + -(-rows * per_row // per_sm) <= num_sms(device)


# --------------------------------------------------------------------------------------------- the selection
def select_ctas(rows: int, device: int, length: int | None = None, *, policy: TopKPolicy | None = None) -> int:
    """CTAs per row of the CUDA selection of ``rows`` rows of ``length`` scores on ``device``: ``select_ctas`` when
    set (clamped to 1 .. ops.MAX_SELECT_CTAS); else the largest C of 8, 4, 2 whose ``rows`` clusters are all
    resident at once (``ops.max_select_clusters``) if it spares each CTA more than ``cluster_min_spared`` scores
    (``length`` · (1 - 1/C)), else 1.
    One CTA of 1024 threads per row leaves the other SMs idle at few rows; a cluster of C splits the row's reads
    C ways, but its steps (the count and histogram exchanges, the funnel into CTA 0, which then sorts alone) cost
    about as much as one CTA's gather of ~8K scores. A smaller C spares fewer scores, so when the largest resident
    C does not pay, none does. Rows of at most ``ops.SELECT_BUF`` scores (gathered whole by index) never take a
    cluster. ``length`` None: the largest resident C."""
    p = _p(policy)
    forced = int(p.select_ctas)
    if forced:
        return max(1, min(ops.MAX_SELECT_CTAS, forced))
    for c in (8, 4, 2):
        if rows <= ops.max_select_clusters(c, device):
            return c if length is None or length * (c - 1) > p.cluster_min_spared * c else 1
    return 1


# ---------------------------------------------------------------------------------------------------- the scan
def scan_npage(T: int, pages: int, sms: int, group: int, *, policy: TopKPolicy | None = None) -> int:
    """Pages per program of the Triton scan for ``T`` rows of ``pages`` pages each, from ``group`` x
    ``scan_npages``.

    The largest multi-page candidate that leaves at least ``scan_min_programs_per_sm`` programs per SM (more pages
    per program load the query tile fewer times; fewer programs leave SMs idle at the end); if none does, the
    smallest multi-page candidate if it leaves ``scan_min_programs_per_sm_small`` per SM (a multi-page program's
    loop overlaps the next page's load with this page's dot; a one-page program has no loop); else the smallest
    candidate (latency-bound calls: as many programs as there are pages).

    Mid sizes (no candidate above the smallest multi-page one leaves that many programs, and the smallest one's
    grid is more than one wave of resident programs): the few waves' fill decides, so the choice is the
    ``scan_wave_npages`` candidate n of least ``waves(n) * n`` (whole waves of ``scan_resident_per_sm`` programs
    per SM, each running n pages), the largest n among equals (a full last wave, fewer query loads).
    """
    p = _p(policy)
    cands = sorted(int(n) * group for n in p.scan_npages)
    multi = [n for n in cands if n > cands[0]]

    def programs(n: int) -> int:
        return T * -(-pages // n)

    for n in reversed(multi[1:]):
        if programs(n) >= float(p.scan_min_programs_per_sm) * sms:
            return n
    if multi and programs(multi[0]) >= float(p.scan_min_programs_per_sm_small) * sms:
        wave = sorted(int(n) * group for n in p.scan_wave_npages)
        slots = int(p.scan_resident_per_sm) * sms
        if wave and programs(wave[0]) > slots:
            return min(wave, key=lambda n: (-(-programs(n) // slots) * n, -n))
        return multi[0]
    return cands[0]


@functools.lru_cache(maxsize=4096)
def cuda_scan_npage(T: int, pages: int, slots: int, cta_pages: float) -> int:
    """Pages per CTA of the CUDA scan for ``T`` rows of ``pages`` pages with ``slots`` resident CTAs on the device:
    the n of least ``waves(n) * (n + cta_pages)`` (whole waves of ``slots`` CTAs, each streaming n pages after a
    start worth ``cta_pages`` pages), the largest n among equals."""
    return min(
        range(1, ops.SCORE_MAX_PAGES + 1),
        key=lambda n: (-(-(T * -(-pages // n)) // slots) * (n + cta_pages), -n),
    )


def cuda_scan_wanted(rows: int, heads: int, *, policy: TopKPolicy | None = None) -> bool:
    """Whether the policy asks for the CUDA scan of ``rows`` query rows of ``heads`` heads (before the checks of
    what it supports): "cuda", or "auto" from ``cuda_scan_min_rows`` rows on (per head tile: heads <= 32 or more)."""
    p = _p(policy)
    if p.scan_backend != "auto":
        return p.scan_backend == "cuda"
    m = p.cuda_scan_min_rows
    return rows >= int(m if isinstance(m, int) else m[0 if heads <= 32 else 1])
