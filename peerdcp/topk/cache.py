"""The index-K cache, :class:`IndexKCache` (SGLang's page layout, owner-sharded or replicated); the FP8 indexer
scoring that reads it is :func:`peerdcp.topk.scorer.indexer_logits`.

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

import math

import torch
import triton

from .._runtime.checks import is_int, resolve_device
from .._runtime.groups import agree_args, all_gather_object, resolve_group
from .._runtime.lifecycle import Collective
from . import reference as ref
from .kernels import _write_kernel

__all__ = ["IndexKCache", "LAYOUTS"]

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


def __getattr__(name: str):
    # indexer_logits moved to .scorer (which imports this module); still importable from here
    if name == "indexer_logits":
        from .scorer import indexer_logits

        return indexer_logits
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
