"""The allgather backend of the Query gather: the bounded all-gather of every rank's packed bf16 shard, then one
fused RoPE + convert pass over the gathered rows (the Triton ``allgather_rope_kernel``, or the plain torch
reference ops for ``impl="torch"``)."""

from __future__ import annotations

import torch
import triton

from .._runtime.groups import bounded_collective
from ..errors import PeerTimeoutError
from . import kernels as K
from .reference import widened_query

__all__ = ["all_gather_into", "rope_convert"]


def rope_convert(qg, g: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, out: torch.Tensor) -> None:
    """``out [T, out_heads, D]`` (``qg.out_dtype``) <- the widened query of ``g [W, T, H, D]`` bf16 (every rank's
    ``[nope | pe]`` rows, gathered), rotated with ``positions [T]`` and ``cos_sin_cache``; ``qg``: the QueryGather."""
    W, T, H = g.shape[0], g.shape[1], g.shape[2]
    if qg.impl == "torch":
        q = widened_query(
            [g[s, :, :, : qg.nope_dim] for s in range(W)],
            [g[s, :, :, qg.nope_dim :] for s in range(W)],
            positions,
            cos_sin_cache,
            rope_style=qg.rope_style,
            out_dtype=qg.out_dtype,
            quant_scale=qg.quant_scale,
            pad_heads_to=qg.out_heads if qg.out_heads > W * H else None,
        )
        out.copy_(q)
        return
    n_main = triton.cdiv(T * W * H, 4)
    n_pad = triton.cdiv(T * (qg.out_heads - W * H), 4)
    K.allgather_rope_kernel[(n_main + n_pad,)](
        g,
        positions,
        cos_sin_cache,
        cos_sin_cache.shape[0],
        qg._bits(out),
        qg.quant_scale,
        T,
        W=W,
        H=H,
        HOUT=qg.out_heads,
        NOPE=qg.nope_dim,
        ROPE=qg.rope_dim,
        BU=4,
        NEOX=qg.rope_style == "neox",
        OUT_FP8=qg.out_dtype == torch.float8_e4m3fn,
        GPU=qg._gpu,
        num_warps=4,
        enable_fp_fusion=False,
    )


def all_gather_into(dst: torch.Tensor, src: torch.Tensor, info, timeout_s: float) -> None:
    """``dst [W * numel(src)]`` <- every rank's ``src`` in rank order (NCCL on GPU, gloo on CPU: bounded by
    ``timeout_s``, see :func:`~peerdcp._runtime.groups.bounded_collective`)."""
    import torch.distributed as dist

    group = info.group if src.is_cuda else info.cpu_group
    # torch >= 2.14 renamed all_gather_into_tensor to all_gather_single (the old name warns)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    # dst as W copies of src stacked along dim 0: NCCL takes any shape of the right size, gloo (also on CUDA
    # tensors: a group of ranks that share a GPU) wants each of its W chunks shaped like src
    stacked = dst.view(info.world_size * src.shape[0], *src.shape[1:]) if src.dim() else dst
    bound = dict(group=group, timeout_s=timeout_s, rank=info.rank, mechanism="query")
    try:
        bounded_collective(ag, stacked, src, **bound)
    except PeerTimeoutError:
        raise  # (a missing peer: the collective is pending, another one must not follow it)
    except (RuntimeError, NotImplementedError):
        if src.is_cuda:
            raise
        parts = list(dst.view(info.world_size, *src.shape).unbind(0))
        bounded_collective(dist.all_gather, parts, src.contiguous(), **bound)
