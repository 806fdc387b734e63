"""The Query gather's arguments: the constructor's checks (:func:`validate_config`, before anything collective)
and each call's input checks (:func:`check_shard`, :func:`check_common`; before any launch or peer store)."""

from __future__ import annotations

import torch

from .. import memory as _memory
from .._runtime.checks import is_int, timeout_problem
from .policy import QueryPolicy
from .reference import ROPE_STYLES

__all__ = ["BACKENDS", "IMPLS", "EXCHANGES", "OUT_DTYPES", "validate_config", "check_shard", "check_common"]

BACKENDS = ("auto", "direct", "allgather")
IMPLS = ("auto", "cuda", "triton", "torch")
EXCHANGES = ("auto", "raw", "roped", "push")
OUT_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


def validate_config(
    world_size: int,
    *,
    max_tokens,
    heads_per_rank,
    nope_dim,
    rope_dim,
    rope_style,
    out_dtype,
    quant_scale,
    backend,
    memory,
    timeout_s,
    pad_heads_to,
    impl,
    exchange,
    num_programs,
    device: torch.device,
    policy,
) -> None:
    """Raise TypeError / ValueError for the first bad constructor argument of a ``world_size``-rank group."""
    W = world_size
    H, nope, rope, style, scale = heads_per_rank, nope_dim, rope_dim, rope_style, quant_scale  # short names
    pad, nprog, dev = pad_heads_to, num_programs, device
    for name, v in (("max_tokens", max_tokens), ("heads_per_rank", H), ("nope_dim", nope), ("rope_dim", rope)):
        if not is_int(v):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if nope % 8:
        raise ValueError(f"nope_dim must be a multiple of 8 (16-byte rows), got {nope}")
    if rope < 16 or rope & (rope - 1):
        raise ValueError(f"rope_dim must be a power of two >= 16 (16-byte rows, pairs), got {rope}")
    if style not in ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float8_e4m3fn or torch.bfloat16, got {out_dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"quant_scale must be a float, got {type(scale).__name__}")
    # the kernels multiply by its fp32 value: 1e39 there is inf (every output saturated), 1e-46 is 0
    scale32 = torch.tensor(float(scale), dtype=torch.float32).item()
    if not (scale32 > 0 and scale32 < float("inf")):
        raise ValueError(f"quant_scale must be positive and finite in fp32, got {scale}")
    if out_dtype == torch.bfloat16 and float(scale) != 1.0:
        raise ValueError(f"quant_scale applies to FP8 output only; must be 1.0 with bfloat16 output, got {scale}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if memory not in _memory.MEMORY_KINDS:
        raise ValueError(f"memory must be one of {_memory.MEMORY_KINDS}, got {memory!r}")
    bad_timeout = timeout_problem(timeout_s)
    if bad_timeout:
        raise ValueError(bad_timeout)
    if pad is not None:
        if not is_int(pad):
            raise TypeError(f"pad_heads_to must be None or an int, got {type(pad).__name__}")
        if pad not in (64, 128):
            raise ValueError(f"pad_heads_to must be None, 64 or 128, got {pad!r}")
        if pad < W * H:
            raise ValueError(f"pad_heads_to={pad} is smaller than the widened heads W*H = {W}*{H} = {W * H}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if backend == "direct" and impl == "torch":
        raise ValueError("impl='torch' exists for backend='allgather' only (the direct backend is a kernel)")
    if backend == "allgather" and impl == "cuda":
        raise ValueError("impl='cuda' exists for backend='direct' only (allgather: 'triton' or 'torch')")
    if impl == "cuda" and dev.type != "cuda":
        raise ValueError(f"impl='cuda' needs a CUDA device, got {dev}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if nprog is not None and (not is_int(nprog) or nprog <= 0):
        raise ValueError(f"num_programs must be a positive int or None, got {nprog!r}")
    if not isinstance(policy, QueryPolicy):
        raise TypeError(f"policy must be a QueryPolicy or None, got {type(policy).__name__}")


def check_shard(qg, name: str, x, width: int) -> int:
    """The tokens T of shard ``x`` of ``qg`` (a QueryGather): ``[T, H, width]`` bf16 on its device."""
    H = qg.heads_per_rank
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != H or x.shape[2] != width:
        raise ValueError(f"{name} must have shape [T, {H}, {width}], got {list(x.shape)}")
    if x.device != qg.device:
        raise ValueError(f"{name} must be on {qg.device}, got {x.device}")
    T = x.shape[0]
    if qg.max_tokens < T:
        raise ValueError(f"{name} has T = {T} tokens, more than max_tokens = {qg.max_tokens}")
    if x.numel() and (x.stride(2) != 1 or x.stride(0) % 8 or x.stride(1) % 8 or x.data_ptr() % 16):
        raise ValueError(
            f"{name} must have a contiguous last dim, strides that are multiples of 8 elements and a "
            f"16-byte aligned data pointer (16-byte rows); got strides {x.stride()}"
        )
    return T


def check_common(qg, T: int, positions, cos_sin_cache, out) -> None:
    """A call's ``positions``, ``cos_sin_cache`` and optional ``out`` for T tokens of ``qg``."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be torch.int32 or torch.int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != T:
        raise ValueError(f"positions must have shape [T] = [{T}], got {list(positions.shape)}")
    if positions.device != qg.device:
        raise ValueError(f"positions must be on {qg.device}, got {positions.device}")
    if T > 1 and positions.stride(0) != 1:
        raise ValueError(f"positions must be contiguous, got stride {positions.stride()}")
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise TypeError(f"cos_sin_cache must be a torch.Tensor, got {type(cos_sin_cache).__name__}")
    if cos_sin_cache.dtype != torch.float32:
        raise TypeError(f"cos_sin_cache must be torch.float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != qg.rope_dim or cos_sin_cache.shape[0] < 1:
        raise ValueError(
            f"cos_sin_cache must have shape [max_pos, {qg.rope_dim}] (rows [cos | sin]), "
            f"got {list(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.device != qg.device:
        raise ValueError(f"cos_sin_cache must be on {qg.device}, got {cos_sin_cache.device}")
    if not cos_sin_cache.is_contiguous() or cos_sin_cache.data_ptr() % 16:
        raise ValueError("cos_sin_cache must be contiguous with a 16-byte aligned data pointer")
    if positions.device.type == "cpu" and T:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"positions must be in [0, {cos_sin_cache.shape[0]}) (rows of cos_sin_cache), got [{lo}, {hi}]"
            )
    if out is not None:
        shape = [T, qg.out_heads, qg.head_dim]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != qg.out_dtype:
            raise TypeError(f"out must be {qg.out_dtype}, got {out.dtype}")
        if list(out.shape) != shape or not out.is_contiguous() or out.device != qg.device or out.data_ptr() % 16:
            raise ValueError(
                f"out must be a contiguous, 16-byte aligned {shape} tensor on {qg.device}, got "
                f"{list(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})"
            )
