"""The indexer scoring, :func:`indexer_logits`: the FP8 lightning-indexer scores of each query row against this
rank's tokens of an :class:`~peerdcp.topk.cache.IndexKCache`, by the CUDA scan (``csrc/topk/score.cu``, through
:func:`.ops.score`) or the Triton ``kernels._logits_kernel``. Which kernel and its work split: :mod:`.policy`.
"""

from __future__ import annotations

import warnings

import torch
import triton

from .._runtime.checks import is_int
from .._runtime.device import num_sms, on_gpu
from . import ops
from . import reference as ref
from .cache import IndexKCache
from .kernels import _logits_kernel
from .policy import TopKPolicy, cuda_scan_npage, cuda_scan_wanted, default_policy, scan_npage

__all__ = ["indexer_logits"]

_UPCAST: dict[tuple, bool] = {}  # (device index, BLOCK_H) -> the FP8 dot failed to compile there
_UNCAPPED: set[tuple] = set()  # (device index, BLOCK_H) where ptxas refused the policy's scan_maxnreg
_NO_CUDA_SCAN: set[int] = set()  # devices where the CUDA scan failed to build or load


def _cuda_scan(
    q_fp8: torch.Tensor, store: torch.Tensor, cache: IndexKCache, dev: torch.device, policy: TopKPolicy
) -> int:
    """Resident CTAs per SM of the CUDA scan for this call, or 0 when it does not apply (see
    :func:`.policy.cuda_scan_wanted`)."""
    rows, H, D = q_fp8.shape
    if (
        not cuda_scan_wanted(rows, H, policy=policy)
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
        return ops.score_resident(dev.index, int(policy.cuda_scan_min_ctas), H)
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
    policy: TopKPolicy | None = None,
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
        policy: the scan's kernel choice and work split (:class:`~peerdcp.topk.policy.TopKPolicy`; None:
            :func:`~peerdcp.topk.policy.default_policy`, read at this call). Ranks that must agree bit for bit
            pass the same one.

    Returns:
        ``[T, L_local_max]`` fp32 with ``L_local_max = local_length(max_seq_len, rank 0)`` (the largest over
        ranks), or ``pages * page_size`` from ``block_table`` when ``max_seq_len`` is None.
    """
    if not isinstance(cache, IndexKCache):
        raise TypeError(f"indexer_logits: cache must be an IndexKCache, got {type(cache).__name__}")
    store = cache._alive("indexer_logits")
    dev = cache.device
    pol = default_policy() if policy is None else policy
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
    resident = _cuda_scan(q_fp8, store, cache, dev, pol) if dev.type == "cuda" else 0
    if resident:
        slots = resident * num_sms(dev.index)
        start = float(pol.cuda_scan_cta_pages)
        npage = int(pol.cuda_scan_npage) or cuda_scan_npage(T, pages, slots, start)
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
            min_ctas=int(pol.cuda_scan_min_ctas),
        )
        return out
    if dev.type == "cuda":
        group = int(pol.scan_group)
        npage = int(pol.scan_npage) or scan_npage(T, pages, num_sms(dev.index), group, policy=pol)
    else:  # the interpreter pays per program and per step, not per element: one dot over every page
        group = npage = triton.next_power_of_2(pages)
    opts = {"num_stages": int(pol.scan_stages)} if dev.type == "cuda" and pol.scan_stages else {}
    pdl = int(pol.scan_pdl) if on_gpu(dev) else 0
    if pdl:
        opts["launch_pdl"] = True
    table = block_table if block_table is not None else seq_lens  # dummy pointer when HAS_TABLE is False
    grid = (T, triton.cdiv(pages, npage))
    # heads padded (zero queries, zero weights) to a power of two; on GPU to >= 64 so Hopper runs the
    # FP8 dot as one warpgroup MMA (m64) for GLM-5's 32 heads too
    block_h = max(64 if dev.type == "cuda" else 16, triton.next_power_of_2(H))

    key = (dev.index if dev.type == "cuda" else -1, block_h)
    cap = int(pol.scan_maxnreg) if dev.type == "cuda" and block_h == 64 and key not in _UNCAPPED else 0

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

    if pol.scan_upcast:  # force the fp16 path (tests, diagnosis; PEERDCP_INDEXER_UPCAST=1)
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
