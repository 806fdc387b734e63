"""This rank's canonical candidates and the merge of candidate lists without peers: the stages of the Top-K that
need no communication, shared by :class:`~peerdcp.topk.TopK` and the single-rank :func:`canonical_topk`.

The local selection (:func:`_local_keys`) takes the CUDA kernel (``csrc/topk/select.cu``, :func:`.ops.select`)
where it builds and fits, else the Triton keys kernel and ``torch.topk``; the merge of gathered lists
(:func:`_merge_lists`) the CUDA merge (:func:`.ops.merge`) or the Triton ``_merge_kernel``. Same output on every
path. Their launch shapes come from :mod:`.policy`.
"""

from __future__ import annotations

import warnings

import torch
import triton

from .._runtime.checks import cuda_index, is_int
from .._runtime.device import mechanism_code, on_gpu
from . import ops
from . import policy as pol
from . import reference as ref
from .kernels import _keys_kernel, _merge_kernel
from .policy import TopKPolicy

__all__ = ["canonical_topk", "MAX_TOPK", "MERGE_IMPLS"]

MAX_TOPK = 1 << 16
MERGE_IMPLS = ("auto", "cuda", "triton")
_MAX_SEQ = (1 << 31) - 1  # ids are int32 and the key keeps 31 id bits


def _check_logits_and_lens(where: str, local_logits, seq_lens, device: torch.device) -> tuple[int, int]:
    if not isinstance(local_logits, torch.Tensor) or local_logits.dtype != torch.float32:
        raise TypeError(f"{where}: local_logits must be an fp32 tensor [T, L_local_max]")
    if local_logits.dim() != 2:
        raise ValueError(f"{where}: local_logits must be 2-D [T, L_local_max], got shape {tuple(local_logits.shape)}")
    T, L = local_logits.shape
    if L > 1 and local_logits.stride(1) != 1:
        raise ValueError(f"{where}: local_logits rows must be contiguous (stride(1) == 1)")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: seq_lens must be an int32/int64 tensor [T]")
    if tuple(seq_lens.shape) != (T,):
        raise ValueError(f"{where}: seq_lens must be [{T}] (one global length per row), got {tuple(seq_lens.shape)}")
    if T > 1 and seq_lens.stride(0) != 1:  # (the kernels read seq_lens[t] at t: a column view read other lengths)
        raise ValueError(f"{where}: seq_lens must be contiguous, got stride {seq_lens.stride()}")
    for name, x in (("local_logits", local_logits), ("seq_lens", seq_lens)):
        if x.device != device:
            raise ValueError(f"{where}: {name} is on {x.device}, expected {device}")
    return T, L


def _check_force(where: str, force_first: int, force_last: int) -> None:
    for name, v in (("force_first", force_first), ("force_last", force_last)):
        if not is_int(v) or not 0 <= v <= _MAX_SEQ:  # (the CUDA kernel takes it as int64: 2^63 wrapped negative)
            raise ValueError(f"{where}: {name} must be an int in [0, {_MAX_SEQ}], got {v!r}")


def _check_lengths_on_host(where: str, seq_lens: torch.Tensor, L: int, rank: int, W: int, I: int) -> None:
    """CPU tensors only (free to read): every row's local length must fit in ``L_local_max``."""
    if seq_lens.device.type != "cpu" or seq_lens.numel() == 0:
        return
    mx, mn = int(seq_lens.max()), int(seq_lens.min())
    if mn < 0 or mx > _MAX_SEQ:
        raise ValueError(f"{where}: seq_lens must lie in [0, {_MAX_SEQ}], got [{mn}, {mx}]")
    need = ref.local_length(mx, rank, W, I)
    if need > L:
        raise ValueError(f"{where}: seq_len {mx} has {need} local tokens on rank {rank}, local_logits holds {L}")


_SELECT_UNAVAILABLE: dict[int, str] = {}  # device index -> why the CUDA selection cannot be used there


def _cuda_select_ok(device: torch.device, n: int, L: int, policy: TopKPolicy) -> bool:
    """Whether ``_local_keys`` takes the CUDA selection (``ops.select``) for ``n`` of ``L`` keys on ``device``."""
    if policy.local_select != "auto" or not on_gpu(device) or L >= (1 << 31) - (1 << 14):
        return False
    idx = cuda_index(device)
    if idx not in _SELECT_UNAVAILABLE:
        try:
            ops.select_max_n()
            _SELECT_UNAVAILABLE[idx] = ""
        except Exception as e:  # noqa: BLE001 - no nvcc / build failure: the Triton + torch path is exact too
            _SELECT_UNAVAILABLE[idx] = f"{type(e).__name__}: {e}"
            msg = f"TopK: CUDA candidate selection unavailable ({e!s:.200}); using the Triton keys + torch.topk path"
            warnings.warn(msg, stacklevel=3)
    return not _SELECT_UNAVAILABLE[idx] and n <= ops.select_max_n()


def _uses_cuda_select(device: torch.device, k: int, L: int, *, policy: TopKPolicy | None = None) -> bool:
    """Whether :func:`_local_keys` takes the CUDA selection (the only path that can publish) for top ``k`` of ``L``
    local columns on ``device``."""
    return L > 0 and _cuda_select_ok(device, min(k, L), L, pol.DEFAULT_POLICY if policy is None else policy)


def _local_keys(
    local_logits, seq_lens, k, rank, W, I, force_first, force_last, publish=None, *, policy: TopKPolicy | None = None
) -> torch.Tensor:
    """``int64 [T, max(1, min(k, L))]``: this rank's canonical candidates, keys descending, -1 tail.

    On a GPU, ``csrc/topk/select.cu`` computes the keys from the scores and selects them in one kernel (radix
    select + shared-memory sort; one CTA per row, or a cluster of up to 8 per row at few rows) for n = min(k, L)
    <= 2048; otherwise (and in the interpreter) the Triton ``_keys_kernel`` writes every key and ``torch.topk`` /
    ``torch.sort`` picks them. Same output. ``publish`` (an ``ops.Publish``; only where :func:`_uses_cuda_select`):
    the selection kernel also publishes each row to the direct Top-K's peers. ``policy``: the selection's path and
    CTAs per row (None: the default)."""
    p = pol.DEFAULT_POLICY if policy is None else policy
    T, L = local_logits.shape
    dev = local_logits.device
    if L == 0:
        return torch.full((T, 1), -1, dtype=torch.int64, device=dev)
    n = min(k, L)
    if publish is not None or _uses_cuda_select(dev, k, L, policy=p):  # (a publishing caller checked it)
        out = torch.empty(T, n, dtype=torch.int64, device=dev)
        ops.select(
            out,
            local_logits,
            seq_lens,
            rank=rank,
            world_size=W,
            interleave=I,
            force_first=force_first,
            force_last=force_last,
            ctas=pol.select_ctas(T, cuda_index(dev), L, policy=p),
            radix_only=p.select_radix_only,
            publish=publish,
        )
        return out
    if publish is not None:
        raise RuntimeError("_local_keys: publish needs the CUDA selection")  # (the caller checks first)
    keys = torch.empty(T, L, dtype=torch.int64, device=dev)
    BLOCK = 1024 if dev.type == "cuda" else min(triton.next_power_of_2(L), 1 << 16)
    _keys_kernel[(T, triton.cdiv(L, BLOCK))](
        local_logits,
        local_logits.stride(0),
        seq_lens,
        keys,
        L,
        rank,
        W,
        I,
        force_first,
        force_last,
        BLOCK=BLOCK,
    )
    if k >= L:
        # every local token is a candidate: just order them (keys are unique, -1 only for padding)
        return torch.sort(keys, dim=1, descending=True).values
    return torch.topk(keys, k, dim=1, largest=True, sorted=True).values


def _merge_block(k: int, wp: int, device: torch.device) -> int:
    if device.type != "cuda":
        return triton.next_power_of_2(k)
    return max(16, min(triton.next_power_of_2(k), 512 // wp))


def _choose_merge_impl(requested: str, device: torch.device, W: int, k: int) -> tuple[str, str]:
    """``(impl, why)`` for the merge kernel (``requested``: one of :data:`MERGE_IMPLS`, checked by the caller):
    ``"cuda"`` (csrc/topk/merge.cu, the lists of a row staged in shared memory) on a GPU when it builds and
    ``W * k`` keys fit one CTA's shared memory, else ``"triton"`` (the interpreter path and twin).
    ``requested="cuda"`` that cannot be met raises ValueError."""
    if requested == "triton":
        return "triton", "triton merge requested"
    why = None
    if not on_gpu(device):
        why = "no GPU (interpreter or CPU)"
    else:
        try:
            cap = ops.max_keys(cuda_index(device))
            if W * k > cap:
                why = f"W*topk = {W * k} keys exceed one CTA's shared memory ({cap})"
        except Exception as e:  # noqa: BLE001 - no nvcc / build failure: say so, use Triton
            why = f"CUDA merge kernel unavailable ({type(e).__name__}: {e})"
    if why is None:
        return "cuda", "cuda merge (csrc/topk/merge.cu)"
    if requested == "cuda":
        raise ValueError(f"TopK: merge_impl='cuda' is not available: {why}")
    return "triton", f"triton merge: {why}"


def _merge_lists(
    out: torch.Tensor, lists: torch.Tensor, W: int, k: int, impl: str = "triton", *, policy: TopKPolicy | None = None
) -> None:
    """Merge ``lists [W, T, n]`` (each row sorted, -1 tail) into ``out [T, k]`` (no peers involved); ``policy``: the
    CUDA merge's grid (None: the default)."""
    _, T, n = lists.shape
    if impl == "cuda":
        lists = lists.contiguous()
        ops.merge(
            out,
            lists=lists.data_ptr(),
            slot_stride=0,
            list_stride=T * n,
            row_stride=n,
            list_len=n,
            world_size=W,
            topk=k,
            direct=False,
            launch_grid=pol.grid(T, W, k, cuda_index(out.device), policy=policy),
        )
        return
    WP = triton.next_power_of_2(W)
    BLOCK = _merge_block(k, WP, out.device)
    out.fill_(-1)
    _merge_kernel[(T, triton.cdiv(k, BLOCK), W)](
        out,
        0,
        0,
        0,
        lists.data_ptr(),
        n,
        0,
        T * n,
        n,
        0,
        0,
        0,
        0,
        1,
        0,
        0,
        W=W,
        WP=WP,
        K=k,
        BLOCK=BLOCK,
        LOGK=k.bit_length(),
        DIRECT=False,
        MECH=mechanism_code("topk"),
        GPU=on_gpu(out.device),
    )


def canonical_topk(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int = 2048,
    *,
    force_first: int = 0,
    force_last: int = 0,
    policy: TopKPolicy | None = None,
) -> torch.Tensor:
    """Single-rank canonical top-k (the replicated-index baseline; no communication).

    Args:
        logits: ``[T, L]`` fp32 scores by global token id (entries at or past a row's length ignored).
        seq_lens: ``[T]`` int32/int64 sequence lengths.
        topk: tokens kept per row.
        force_first, force_last: the first / last this many tokens of each row are scored +inf.
        policy: the selection's and the merge's launch shapes (None: the default; the ids never depend on it).

    Returns:
        ``[T, topk]`` int32 ids in canonical order (score desc, id asc, NaN lowest, -0 == +0), -1 padded.
    """
    if not is_int(topk) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"canonical_topk: topk must be an int in [1, {MAX_TOPK}], got {topk!r}")
    T, L = _check_logits_and_lens("canonical_topk", logits, seq_lens, logits.device)
    _check_force("canonical_topk", force_first, force_last)
    _check_lengths_on_host("canonical_topk", seq_lens, L, 0, 1, 1)
    out = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    if T == 0:
        return out
    keys = _local_keys(logits, seq_lens, topk, 0, 1, 1, force_first, force_last, policy=policy)
    _merge_lists(out, keys[None], 1, topk, policy=policy)
    return out
