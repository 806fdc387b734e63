"""The index-K cache (SGLang's page layout, owner-sharded or replicated) and the FP8 indexer scoring.

Layout of one page (``page_size`` P = 64 tokens, ``head_dim`` D = 128): ``P*D`` FP8 e4m3 bytes, token-major
(token ``o`` at byte ``o*D``), then ``P`` fp32 scales (token ``o`` at byte ``P*D + 4*o``): 8448 bytes, exactly
SGLang's ``DSATokenToKVPool`` page, so DeepGEMM-style paged kernels read it as ``[pages, 64, 1, 132]``
(:meth:`IndexKCache.deepgemm_view`).

**Addressing.** Tokens are written by *logical slot*. A sequence occupies the logical slots
``start .. start + L - 1`` (token ``g`` of the sequence at slot ``start + g``), where ``start`` is a multiple of
:attr:`IndexKCache.seq_align` (``W * lcm(interleave, page_size)`` owner-sharded, ``page_size`` replicated).
With that alignment the owner of slot ``start + g`` is the owner of token ``g`` (DESIGN.md section 3), its
local row is ``local_row(start) + local_row(g)``, and each rank's rows of the sequence fill whole local
pages starting at page ``local_row(start) // P``. :func:`indexer_logits` reads each query row's pages
through a DeepGEMM-style ``block_table [T, pages] int32`` (local physical page of the row's j-th local
page; :meth:`IndexKCache.block_table` builds it from ``start``), or, without a table, every row reads the
sequence at ``start = 0`` (one sequence, 1 or more query rows: decode + MTP). Rows of the same sequence
may have different ``seq_lens``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import triton

from .._runtime.checks import is_int, resolve_device
from .._runtime.device import num_sms, on_gpu
from .._runtime.groups import agree_args, all_gather_object, resolve_group
from .._runtime.lifecycle import Collective
from . import ops
from . import reference as ref
from .kernels import _logits_kernel, _write_kernel

__all__ = ["IndexKCache", "indexer_logits", "LAYOUTS"]

LAYOUTS = ("owner_sharded", "replicated")


class IndexKCache(Collective):
    """FP8 index keys of the lightning indexer, in SGLang's page layout, on this rank.

    Args:
        group: the DCP ``ProcessGroup`` (None = default group). Construction is collective: every rank
            must pass the same geometry (else ``ValueError`` on every rank).
        capacity_tokens: logical token slots over the whole group, rounded up to a multiple of
            :attr:`seq_align`. Owner-sharded, each rank stores ``capacity_tokens / W`` of them.
        head_dim: bytes per key (FP8 elements), a power of two >= 32 (128 for DeepSeek-V3.2 / GLM-5).
        page_size: tokens per page, a power of two >= 16 (SGLang/DeepGEMM: 64).
        layout: ``"owner_sharded"`` (rank r keeps the tokens it owns at their local rows) or
            ``"replicated"`` (every rank keeps every token, row = slot).
        interleave: ownership interleave I (must equal the ``TopK``'s).
        device: CUDA device (default: current) or ``"cpu"``.

    Attributes: ``rank``, ``world_size``, ``layout``, ``capacity_tokens``, ``local_capacity`` (physical
    tokens per rank), ``num_pages``, ``page_bytes``, ``nbytes`` (bytes per rank), ``seq_align``,
    ``storage`` (``uint8 [num_pages, page_bytes]``), ``backend`` (= layout), ``memory`` (``"device"``: plain
    local memory, nothing is peer-mapped), ``reason``.
    """

    def __init__(
        self,
        group=None,
        *,
        capacity_tokens: int,
        head_dim: int = 128,
        page_size: int = 64,
        layout: str = "owner_sharded",
        interleave: int = 1,
        device: torch.device | str | int | None = None,
    ) -> None:
        # the arguments are checked on every rank, then agreed: a rank with a bad one raises its error and every
        # other rank a PeerSetupError naming it (none waits for it in the geometry exchange)
        local_err: BaseException | None = None
        dev = None
        try:
            for name, v in (("capacity_tokens", capacity_tokens), ("head_dim", head_dim), ("page_size", page_size)):
                if not is_int(v):
                    raise TypeError(f"IndexKCache: {name} must be an int, got {type(v).__name__}")
            if not is_int(interleave):
                raise TypeError(f"IndexKCache: interleave must be an int, got {type(interleave).__name__}")
            if capacity_tokens <= 0:
                raise ValueError(f"IndexKCache: capacity_tokens must be positive, got {capacity_tokens}")
            if head_dim < 32 or head_dim & (head_dim - 1):
                raise ValueError(f"IndexKCache: head_dim must be a power of two >= 32, got {head_dim}")
            if page_size < 16 or page_size & (page_size - 1):
                raise ValueError(f"IndexKCache: page_size must be a power of two >= 16, got {page_size}")
            if layout not in LAYOUTS:
                raise ValueError(f"IndexKCache: layout must be one of {LAYOUTS}, got {layout!r}")
            if interleave < 1:
                raise ValueError(f"IndexKCache: interleave must be >= 1, got {interleave}")
            dev = resolve_device(device, owner="IndexKCache: ")
        except (TypeError, ValueError) as e:
            local_err = e
        info = resolve_group(group, local_err)
        agree_args(info, local_err, "IndexKCache")
        geo = (capacity_tokens, head_dim, page_size, layout, interleave, dev.type)
        geos = all_gather_object(info, geo)
        if len(set(geos)) != 1:
            raise ValueError(
                "IndexKCache: ranks passed different geometry (capacity_tokens, head_dim, page_size, layout, "
                f"interleave, device type): {geos}"
            )
        W = info.world_size
        self._info = info
        self.rank, self.world_size = info.rank, W
        self.layout, self.interleave = layout, interleave
        self.head_dim, self.page_size = head_dim, page_size
        self.device = dev
        self.sharded = layout == "owner_sharded"
        self.seq_align = W * math.lcm(interleave, page_size) if self.sharded else page_size
        self.capacity_tokens = -(-capacity_tokens // self.seq_align) * self.seq_align
        self.local_capacity = self.capacity_tokens // W if self.sharded else self.capacity_tokens
        self.num_pages = self.local_capacity // page_size
        self.page_bytes = page_size * head_dim + 4 * page_size
        self.nbytes = self.num_pages * self.page_bytes
        self.storage: torch.Tensor | None = torch.zeros(self.num_pages, self.page_bytes, dtype=torch.uint8, device=dev)
        self.backend = layout
        self.memory = "device"
        self.reason = (
            f"{layout}: rank {self.rank} stores {self.local_capacity} of {self.capacity_tokens} logical tokens "
            f"({self.num_pages} pages of {self.page_bytes} B); no peer mapping (each rank scores only its pages)"
        )

    # ------------------------------------------------------------------------------------- helpers
    def _alive(self, where: str = "storage") -> torch.Tensor:
        self._ready(where)
        return self.storage

    def capacity_report(self) -> dict:
        """Physical tokens and bytes per rank vs a replicated cache of the same logical capacity."""
        rep_bytes = (self.capacity_tokens // self.page_size) * self.page_bytes
        return {
            "layout": self.layout,
            "world_size": self.world_size,
            "interleave": self.interleave,
            "logical_tokens": self.capacity_tokens,
            "physical_tokens_per_rank": self.local_capacity,
            "page_bytes": self.page_bytes,
            "bytes_per_rank": self.nbytes,
            "replicated_bytes_per_rank": rep_bytes,
            "bytes_saved_per_rank": rep_bytes - self.nbytes,
            "fraction_of_replicated": self.nbytes / rep_bytes,
        }

    def deepgemm_view(self) -> torch.Tensor:
        """``uint8 [num_pages, page_size, 1, head_dim + 4]``: the shape DeepGEMM's paged MQA logits take
        (a shape only: the scales sit at ``page_base + page_size*head_dim``, as in SGLang)."""
        return self._alive("deepgemm_view").view(self.num_pages, self.page_size, 1, self.head_dim + 4)

    def local_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owned [N] bool, row [N] int64)``: whether this rank stores each logical slot, and where."""
        s = slots.to(torch.int64)
        if self.sharded:
            W, I = self.world_size, self.interleave
            own = (ref.owner(s, W, I) == self.rank) & (s >= 0) & (s < self.capacity_tokens)
            return own, torch.where(own, ref.local_row(s, W, I), 0)
        own = (s >= 0) & (s < self.capacity_tokens)
        return own, torch.where(own, s, 0)

    def block_table(self, seq_starts: torch.Tensor, num_pages: int) -> torch.Tensor:
        """``int32 [B, num_pages]``: local pages of sequences starting at logical slots ``seq_starts [B]``
        (multiples of :attr:`seq_align`, checked where ``seq_starts`` is on the CPU), for :func:`indexer_logits`.
        Pages past the cache are clamped. (The scan kernels clamp any table entry into ``[0, num_pages)``: a
        wrong entry reads a wrong page of this cache - finite scores of other tokens - never out of bounds.)"""
        if not isinstance(seq_starts, torch.Tensor) or seq_starts.dim() != 1:
            raise ValueError("IndexKCache.block_table: seq_starts must be a 1-D integer tensor [B]")
        if seq_starts.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"IndexKCache.block_table: seq_starts must be int32/int64, got {seq_starts.dtype}")
        if not is_int(num_pages) or num_pages < 0:
            raise ValueError(f"IndexKCache.block_table: num_pages must be an int >= 0, got {num_pages!r}")
        if seq_starts.device.type == "cpu" and seq_starts.numel():
            bad = seq_starts[(seq_starts < 0) | (seq_starts % self.seq_align != 0)]
            if bad.numel():  # (a start off the alignment tables the pages of other tokens)
                raise ValueError(
                    f"IndexKCache.block_table: seq_starts must be non-negative multiples of seq_align = "
                    f"{self.seq_align}, got {bad[:4].tolist()}"
                )
        start = seq_starts.to(torch.int64)
        first = (start // self.world_size if self.sharded else start) // self.page_size
        pages = first[:, None] + torch.arange(num_pages, device=start.device)[None, :]
        return pages.clamp(max=self.num_pages - 1).to(torch.int32)

    # -------------------------------------------------------------------------------- write / read
    def write(self, slots: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> None:
        """Store keys by logical slot; owner-sharded keeps only this rank's tokens (at their local rows).

        Args:
            slots: ``[N]`` int32/int64 logical slots (sequence start + position); slots outside
                ``[0, capacity_tokens)`` are skipped (SGLang pads with -1). Slots must be distinct: of two writes
                to one slot either may land (on a GPU the key bytes and the scale are separate stores, so they
                may even mix); not checked, which would cost a sort and a device sync.
            k_fp8: ``[N, head_dim]`` float8_e4m3fn, rows contiguous.
            k_scale: ``[N]`` or ``[N, 1]`` fp32 per-token scales.
        """
        store = self._alive("write")
        D = self.head_dim
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise TypeError("IndexKCache.write: slots must be a 1-D int32/int64 tensor [N]")
        N = slots.shape[0]
        if not isinstance(k_fp8, torch.Tensor) or k_fp8.dtype != torch.float8_e4m3fn:
            raise TypeError("IndexKCache.write: k_fp8 must be a float8_e4m3fn tensor [N, head_dim]")
        if tuple(k_fp8.shape) != (N, D) or (N > 0 and k_fp8.stride() != (D, 1)):
            raise ValueError(f"IndexKCache.write: k_fp8 must be contiguous [{N}, {D}], got {tuple(k_fp8.shape)}")
        if not isinstance(k_scale, torch.Tensor) or k_scale.dtype != torch.float32:
            raise TypeError("IndexKCache.write: k_scale must be an fp32 tensor [N] or [N, 1]")
        if k_scale.dim() not in (1, 2) or k_scale.numel() != N or k_scale.shape[0] != N:
            raise ValueError(f"IndexKCache.write: k_scale must be [{N}] or [{N}, 1], got {tuple(k_scale.shape)}")
        for name, x in (("slots", slots), ("k_fp8", k_fp8), ("k_scale", k_scale)):
            if x.device != self.device:
                raise ValueError(f"IndexKCache.write: {name} is on {x.device}, the cache on {self.device}")
        if N == 0:
            return
        k_scale = k_scale.reshape(N).contiguous()
        slots = slots.contiguous()
        BLOCK_N = 16 if self.device.type == "cuda" else 1024
        _write_kernel[(triton.cdiv(N, BLOCK_N),)](
            slots,
            k_fp8.view(torch.uint8),
            k_scale,
            store.view(-1),
            store.view(-1).view(torch.float32),
            N,
            self.rank,
            self.world_size,
            self.interleave,
            self.capacity_tokens,
            SHARDED=self.sharded,
            PAGE=self.page_size,
            PAGE_BYTES=self.page_bytes,
            D=D,
            BLOCK_N=BLOCK_N,
        )

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Test helper (plain torch): ``(k_fp8 [N, D], k_scale [N], owned [N] bool)`` for logical slots;
        rows this rank does not store read as zeros / NaN."""
        store = self._alive("read")
        P, D = self.page_size, self.head_dim
        own, row = self.local_rows(slots.to(self.device))
        page, off = row // P, row % P
        data = store[:, : P * D].reshape(self.num_pages, P, D)[page, off]
        scales = store[:, P * D :].contiguous().view(torch.float32)[page, off]
        data = torch.where(own[:, None], data, torch.zeros_like(data)).view(torch.float8_e4m3fn)
        scales = torch.where(own, scales, torch.full_like(scales, float("nan")))
        return data, scales, own

    # ------------------------------------------------------------------------------------- lifetime
    def _release(self) -> None:
        # the pages only (no peer mapping: nothing here waits on a peer, so close needs no collective step)
        self.storage = None

    def __repr__(self) -> str:
        return (
            f"IndexKCache(layout={self.layout!r}, rank={self.rank}/{self.world_size}, interleave={self.interleave}, "
            f"capacity_tokens={self.capacity_tokens}, pages={self.num_pages}x{self.page_bytes}B, device={self.device})"
        )


# ----------------------------------------------------------------------------------------- scoring
_UPCAST: dict[tuple, bool] = {}  # (device index, BLOCK_H) -> the FP8 dot failed to compile there
_UNCAPPED: set[tuple] = set()  # (device index, BLOCK_H) where ptxas refused TUNING["scan_maxnreg"]


# The scoring kernel's work split and backend. Figures: DeepSeek-V3.2 indexer (64 heads x 128, FP8) unless said,
# us replicated / owner-sharded, 2 x H200 or a one-GPU emulation of W = 2 (scripts/diag/score_sweep.py, in git
# history; the
# tables: bench/RESULTS.md, Top-K indexer scan).
# "scan_group": pages per dot, the same for every call, so a token's score does not depend on the call's size
# (owner-sharded and replicated scans agree bit for bit). 1 page per dot: 3.40 / 2.89 at 1 row x 32K, 46.7 / 27.4
# at 32 x 32K, 677 / 347 at 128 x 128K; 2 pages per dot is 7-15 % faster up to 8 rows and 5-25 % slower from 32
# rows. "scan_npage": pages per program (0: _scan_npage).
# "scan_stages": the page loop's software-pipeline depth (num_stages; 0 = Triton's default, 3 on Hopper). 2 is
# faster or equal everywhere (default -> 2: 46.8 / 27.4 -> 46.0 / 25.2 at 32 x 32K, 707 / 344 -> 642 / 329 at
# 128 x 128K; 1 row, one page per program and no loop: unchanged).
# "scan_npages" / "scan_min_programs_per_sm" / "..._small": the policy _scan_npage. Against {1, 4, 16} at >= 8
# programs per SM: 8 x 32K 16.25 / 9.66 -> 13.32 / 8.21, 32 x 32K 46.13 / 25.24 -> 43.59 / 24.82, 64 x 32K
# 88.07 / 43.83 -> 81.62 / 45.58, 8 x 128K 46.23 / 25.10 -> 43.24 / 24.72. 4 pages per program at ~31 programs
# per SM measured slower than 2 (8 x 128K: 46.3 vs 43.2 replicated), so 4 is not a candidate. The small floor,
# 3 per SM (396 programs on H200): 2 pages per program beat 1 from 512 programs on (1 x 128K sharded 4.39 vs
# 4.77, 2 x 32K replicated 4.29 vs 4.62) and lose at 256 and fewer (2 x 32K sharded 3.60 vs 3.49).
# "scan_wave_npages" / "scan_resident_per_sm": the mid-size rule of _scan_npage (an empty tuple turns it off). 8
# resident programs per SM is the compiled kernel's occupancy on H200 with "scan_maxnreg" 64 (7 uncapped: 72
# registers; score_sweep's kernel report). 7 and 9 among the candidates: 8 x 128K sharded 23.48 -> 22.57 (9
# pages: 912 programs, one wave, instead of 10), 16 x 32K replicated 23.29 -> 22.36.
# "scan_pdl": launch with programmatic dependent launch (kernel_support.grid_dependency_sync): 0 off, 1 wait for the
# previous kernel inside the kernel, 2 also let the next PDL kernel launch as soon as every program started.
# "scan_maxnreg": a register cap for the FP8 scan with a 64-head tile (DeepSeek-V3.2's 64 heads, GLM-5's 32; Triton's
# maxnreg; 0 = none): 64 holds 8 programs per SM instead of 7 (72 registers uncapped; no spills at 2 stages). Wider
# tiles (more heads) keep 64 x BLOCK_H fp32 accumulators per program and the fp16 fallback other operands: no cap.
# Uncapped at 7 per SM -> capped at 8: 2-5 % faster at 32-128 rows (32 x 32K 41.26 / 23.46 -> 40.62 / 22.49, 128 x
# 32K 159.3 / 82.3 -> 155.9 / 79.5); the one loss 128 x 128K replicated 615.3 -> 625.3 (1.6 %); 1-8 rows within
# 0.15 us.
# "scan_backend": "triton" (_logits_kernel), "cuda" (csrc/topk/score.cu, warpgroup MMA with the keys as the register
# operand; Hopper, 64-token pages of 128-byte keys, up to 64 heads, 16-byte aligned query rows, else the Triton kernel)
# or "auto": the CUDA scan from "cuda_scan_min_rows" query rows on - (a head tile of 32: H <= 32, of 64), or one int for
# both. The choice depends on the rows and heads only, never on the cache's layout or length, so an owner-sharded and a
# replicated scan of the same rows take the same kernel and agree bit for bit. Triton -> CUDA: 8 x 32K 13.24 / 8.17 ->
# 12.29 / 8.07, 128 x 128K 632.0 / 317.5 -> 607.7 / 309.7; GLM-5 (32 heads) 128 x 128K 605.8 / 312.9 -> 543.0 /
# 275.5. At one page per CTA the CUDA kernel executes ~45 % more instructions (ncu) and its start costs: hence the
# rows' floor. 32 heads, 1 row: 3.11 / 2.74 -> 3.07 / 2.78 at 32K, 8.09 / 4.25 -> 7.12 / 3.92 at 128K, 2-3 rows
# 0.1-2.2 us faster at every point; 64 heads, 3 rows: 6.96 / 4.09 -> 6.54 / 4.39 at 32K, 17.63 / 11.55 -> 16.23 /
# 9.63 at 128K, 1-2 rows slower at 32K. "cuda_scan_min_ctas": its register budget as CTAs per SM
# (ops.SCORE_MIN_CTAS; 8 spills and runs 2x slower); page slots filled by bulk copies measured no faster (2) or
# slower (3-6), not kept. "cuda_scan_npage": pages per CTA (0:
# _cuda_scan_npage with a CTA's start worth "cuda_scan_cta_pages" pages; fixed 2-10 measured slower at 8-64 rows).
TUNING = {
    "scan_backend": "auto",
    "cuda_scan_min_rows": (1, 3),
    "cuda_scan_min_ctas": 6,
    "cuda_scan_npage": 0,
    "cuda_scan_cta_pages": 2.0,
    "scan_group": 1,
    "scan_npage": 0,
    "scan_stages": 2,
    "scan_npages": (1, 2, 8, 16),
    "scan_min_programs_per_sm": 30,
    "scan_min_programs_per_sm_small": 3,
    "scan_wave_npages": (2, 5, 6, 7, 8, 9, 10, 12),
    "scan_resident_per_sm": 8,
    "scan_pdl": 0,
    "scan_maxnreg": 64,
}


def _scan_npage(T: int, pages: int, sms: int, group: int) -> int:
    """Pages per program for ``T`` rows of ``pages`` pages each, from ``group`` x ``TUNING["scan_npages"]``.

    The largest multi-page candidate that leaves at least ``TUNING["scan_min_programs_per_sm"]`` programs per SM
    (more pages per program load the query tile fewer times; fewer programs leave SMs idle at the end); if
    none does, the smallest multi-page candidate if it leaves ``TUNING["scan_min_programs_per_sm_small"]`` per
    SM (a multi-page program's loop overlaps the next page's load with this page's dot; a one-page program
    has no loop); else the smallest candidate (latency-bound calls: as many programs as there are pages).

    Mid sizes (no candidate above the smallest multi-page one leaves that many programs, and the smallest one's
    grid is more than one wave of resident programs): the few waves' fill decides, so the choice is the
    ``TUNING["scan_wave_npages"]`` candidate n of least ``waves(n) * n`` (whole waves of ``scan_resident_per_sm``
    programs per SM, each running n pages), the largest n among equals (a full last wave, fewer query loads).
    """
    cands = sorted(int(n) * group for n in TUNING["scan_npages"])
    multi = [n for n in cands if n > cands[0]]

    def programs(n: int) -> int:
        return T * -(-pages // n)

    for n in reversed(multi[1:]):
        if programs(n) >= float(TUNING["scan_min_programs_per_sm"]) * sms:
            return n
    if multi and programs(multi[0]) >= float(TUNING["scan_min_programs_per_sm_small"]) * sms:
        wave = sorted(int(n) * group for n in TUNING["scan_wave_npages"])
        slots = int(TUNING["scan_resident_per_sm"]) * sms
        if wave and programs(wave[0]) > slots:
            return min(wave, key=lambda n: (-(-programs(n) // slots) * n, -n))
        return multi[0]
    return cands[0]


@functools.lru_cache(maxsize=4096)
def _cuda_scan_npage(T: int, pages: int, slots: int, cta_pages: float) -> int:
    """Pages per CTA of the CUDA scan for ``T`` rows of ``pages`` pages with ``slots`` resident CTAs on the device:
    the n of least ``waves(n) * (n + cta_pages)`` (whole waves of ``slots`` CTAs, each streaming n pages after a
    start - table entries, query tile, the first page's latency - worth ``cta_pages`` pages), the largest n among
    equals."""
    return min(
        range(1, ops.SCORE_MAX_PAGES + 1),
        key=lambda n: (-(-(T * -(-pages // n)) // slots) * (n + cta_pages), -n),
    )


_NO_CUDA_SCAN: set[int] = set()  # devices where the CUDA scan failed to build or load


def _cuda_scan_wanted(rows: int, heads: int) -> bool:
    """Whether TUNING asks for the CUDA scan of ``rows`` query rows of ``heads`` heads (before the checks of what it
    supports): "cuda", or "auto" from ``cuda_scan_min_rows`` rows on (per head tile: heads <= 32 or more)."""
    backend = TUNING["scan_backend"]
    if backend != "auto":
        return backend == "cuda"
    m = TUNING["cuda_scan_min_rows"]
    return rows >= int(m if isinstance(m, int) else m[0 if heads <= 32 else 1])


def _cuda_scan(q_fp8: torch.Tensor, store: torch.Tensor, cache: IndexKCache, dev: torch.device) -> int:
    """Resident CTAs per SM of the CUDA scan for this call, or 0 when it does not apply (see TUNING)."""
    rows, H, D = q_fp8.shape
    if (
        not _cuda_scan_wanted(rows, H)
        or dev.index in _NO_CUDA_SCAN
        or cache.page_size != 64
        or D != 128
        or cache.page_bytes != 64 * 128 + 64 * 4
        or H > 64
        or q_fp8.data_ptr() % 16
        or q_fp8.stride(0) % 16
        or store.data_ptr() % 16
    ):
        return 0
    try:  # (0 on a GPU other than Hopper)
        return ops.score_resident(dev.index, int(TUNING["cuda_scan_min_ctas"]), H)
    except Exception as e:  # noqa: BLE001 - no nvcc, a build or driver refusal: the Triton kernel scores instead
        _NO_CUDA_SCAN.add(dev.index)
        msg = f"indexer_logits: the CUDA scan is unavailable ({e!s:.200}); using the Triton kernel"
        warnings.warn(msg, stacklevel=3)
        return 0


def indexer_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    cache: IndexKCache,
    seq_lens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Lightning-indexer scores of each query row against this rank's tokens of its sequence.

    ``logits[t, l] = k_scale[l] * sum_h ReLU(q_fp8[t, h] . k_fp8[l]) * weights[t, h]`` (fp32, FP8 x FP8 dot
    with fp32 accumulation) for local rows ``l`` below the row's local length; ``-inf`` from there on.
    With an owner-sharded cache local row ``l`` is global token ``global_id(l, rank)``; replicated, ``l = g``.

    Args:
        q_fp8: ``[T, H, D]`` float8_e4m3fn (``D = cache.head_dim``; each row ``[H, D]`` contiguous).
        weights: ``[T, H]`` fp32 head weights (query scales and ``H^-0.5 * D^-0.5`` folded in).
        cache: the :class:`IndexKCache`.
        seq_lens: ``[T]`` int32/int64 **global** sequence lengths (tokens ``0 .. L-1`` are attended).
        block_table: optional ``[T, pages]`` int32 local pages per row (see :meth:`IndexKCache.block_table`);
            None: every row reads the sequence at logical slot 0. Local rows past ``pages * page_size`` score
            -inf (a row whose length exceeds its table reads no page outside it).
        max_seq_len: the largest ``seq_lens`` entry (host int). Sets ``L_local_max`` without a device
            sync; needed under CUDA-graph capture unless ``block_table`` is given.

    Returns:
        ``[T, L_local_max]`` fp32 with ``L_local_max = local_length(max_seq_len, rank 0)`` (the largest over
        ranks), or ``pages * page_size`` from ``block_table`` when ``max_seq_len`` is None.
    """
    if not isinstance(cache, IndexKCache):
        raise TypeError(f"indexer_logits: cache must be an IndexKCache, got {type(cache).__name__}")
    store = cache._alive("indexer_logits")
    dev = cache.device
    if not isinstance(q_fp8, torch.Tensor) or q_fp8.dtype != torch.float8_e4m3fn or q_fp8.dim() != 3:
        raise TypeError("indexer_logits: q_fp8 must be a float8_e4m3fn tensor [T, H, D]")
    T, H, D = q_fp8.shape
    if cache.head_dim != D:
        raise ValueError(f"indexer_logits: q_fp8 head dim must equal cache.head_dim = {cache.head_dim}, got {D}")
    if H < 1 or H > 256:
        raise ValueError(f"indexer_logits: q_fp8 must have 1 to 256 heads, got {H}")
    if q_fp8.stride(2) != 1 or q_fp8.stride(1) != D:
        raise ValueError("indexer_logits: q_fp8 rows [H, D] must be contiguous")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32:
        raise TypeError("indexer_logits: weights must be an fp32 tensor [T, H]")
    if tuple(weights.shape) != (T, H) or weights.stride(1) != 1:
        raise ValueError(f"indexer_logits: weights must be [{T}, {H}] with contiguous rows, got {tuple(weights.shape)}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError("indexer_logits: seq_lens must be an int32/int64 tensor [T]")
    if tuple(seq_lens.shape) != (T,):
        raise ValueError(f"indexer_logits: seq_lens must be [{T}], got {tuple(seq_lens.shape)}")
    if T > 1 and seq_lens.stride(0) != 1:  # (the kernels read seq_lens[t] at t: a column view read other lengths)
        raise ValueError(f"indexer_logits: seq_lens must be contiguous, got stride {seq_lens.stride()}")
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError("indexer_logits: block_table must be an int32 tensor [T, pages]")
        if block_table.dim() != 2 or block_table.shape[0] != T or block_table.stride(1) != 1:
            raise ValueError(f"indexer_logits: block_table must be [{T}, pages] with contiguous rows")
    for name, x in (("q_fp8", q_fp8), ("weights", weights), ("seq_lens", seq_lens), ("block_table", block_table)):
        if x is not None and x.device != dev:
            raise ValueError(f"indexer_logits: {name} is on {x.device}, the cache on {dev}")
    W, I = cache.world_size, cache.interleave
    if max_seq_len is None and block_table is None:
        max_seq_len = int(seq_lens.max()) if T else 0  # device sync: pass max_seq_len to avoid it
    if max_seq_len is not None:
        if not is_int(max_seq_len) or max_seq_len < 0:
            raise ValueError(f"indexer_logits: max_seq_len must be a non-negative int, got {max_seq_len!r}")
        Lmax = ref.local_length(max_seq_len, 0, W, I) if cache.sharded else max_seq_len
        if Lmax > cache.local_capacity:  # (no sequence holds more; with a block table too, where 2^40 was allocated)
            raise ValueError(
                f"indexer_logits: max_seq_len {max_seq_len} needs {Lmax} local rows, the cache holds "
                f"{cache.local_capacity} per rank"
            )
    else:
        Lmax = block_table.shape[1] * cache.page_size
    out = torch.empty(T, Lmax, dtype=torch.float32, device=dev)
    if T == 0 or Lmax == 0:
        return out
    P = cache.page_size
    pages = triton.cdiv(Lmax, P)
    resident = _cuda_scan(q_fp8, store, cache, dev) if dev.type == "cuda" else 0
    if resident:
        slots = resident * num_sms(dev.index)
        start = float(TUNING["cuda_scan_cta_pages"])
        npage = int(TUNING["cuda_scan_npage"]) or _cuda_scan_npage(T, pages, slots, start)
        npage = min(ops.SCORE_MAX_PAGES, max(npage, -(-pages // 65535)))  # (the grid's y is at most 65535 blocks)
        ops.score(
            out,
            q_fp8,
            weights,
            seq_lens,
            block_table,
            store,
            num_pages=cache.num_pages,
            rank=cache.rank,
            world_size=W,
            interleave=I,
            sharded=cache.sharded,
            npage=npage,
            min_ctas=int(TUNING["cuda_scan_min_ctas"]),
        )
        return out
    if dev.type == "cuda":
        group = int(TUNING["scan_group"])
        npage = int(TUNING["scan_npage"]) or _scan_npage(T, pages, num_sms(dev.index), group)
    else:  # the interpreter pays per program and per step, not per element: one dot over every page
        group = npage = triton.next_power_of_2(pages)
    opts = {"num_stages": int(TUNING["scan_stages"])} if dev.type == "cuda" and TUNING["scan_stages"] else {}
    pdl = int(TUNING["scan_pdl"]) if on_gpu(dev) else 0
    if pdl:
        opts["launch_pdl"] = True
    table = block_table if block_table is not None else seq_lens  # dummy pointer when HAS_TABLE is False
    grid = (T, triton.cdiv(pages, npage))
    # heads padded (zero queries, zero weights) to a power of two; on GPU to >= 64 so Hopper runs the
    # FP8 dot as one warpgroup MMA (m64) for GLM-5's 32 heads too
    block_h = max(64 if dev.type == "cuda" else 16, triton.next_power_of_2(H))

    key = (dev.index if dev.type == "cuda" else -1, block_h)
    cap = int(TUNING["scan_maxnreg"]) if dev.type == "cuda" and block_h == 64 and key not in _UNCAPPED else 0

    def launch(dot: int) -> None:
        _logits_kernel[grid](
            q_fp8,
            q_fp8.stride(0),
            weights,
            weights.stride(0),
            seq_lens,
            table,
            table.stride(0) if block_table is not None else 0,
            table.shape[1] if block_table is not None else 0,
            store.view(-1).view(torch.float8_e4m3fn),
            store.view(-1).view(torch.float32),
            out,
            out.stride(0),
            Lmax,
            H,
            cache.num_pages,
            cache.rank,
            W,
            I,
            NPAGE=npage,
            GROUP=group,
            PAGE=P,
            PAGE_BYTES=cache.page_bytes,
            D=D,
            BLOCK_H=block_h,
            HAS_TABLE=block_table is not None,
            SHARDED=cache.sharded,
            DOT=dot,
            PDL=pdl,
            num_warps=4,
            **opts,
            **({"maxnreg": cap} if cap and dot == 0 else {}),
        )

    if os.environ.get("PEERDCP_INDEXER_UPCAST") == "1":  # force the fp16 path (tests, diagnosis)
        launch(1)
    elif dev.type != "cuda":
        launch(2)  # interpreter: exact fp64 head dots
    elif _UPCAST.get(key):
        launch(1)
    else:
        try:
            launch(0)
        except Exception as e:  # noqa: BLE001 - a compiler refusal; both fallbacks are exact
            if cap:  # ptxas refuses a cap below what an instruction needs: the uncapped kernel, same bits
                _UNCAPPED.add(key)
                cap = 0
                warnings.warn(f"indexer_logits: register cap refused ({e!s:.200}); scoring uncapped", stacklevel=2)
                try:
                    launch(0)
                    _UPCAST[key] = False
                    return out
                except Exception as e2:  # noqa: BLE001
                    e = e2
            if key in _UPCAST:  # the FP8 kernel compiled here before: not a compiler refusal of the FP8 dot
                raise e
            msg = f"indexer_logits: FP8 tl.dot failed to compile ({e!s:.200}); using the fp16 path"
            warnings.warn(msg, stacklevel=2)
            _UPCAST[key] = True
            launch(1)
        else:
            _UPCAST[key] = False
    return out
