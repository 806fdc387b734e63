"""The OutputReducer's constructor arguments: local checks, then agreement on them and on the geometry (every rank
raises the same error, before anything is allocated)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._runtime.checks import resolve_device, timeout_problem
from .._runtime.groups import all_gather_object
from . import kernels as K
from .policy import DEFAULT_POLICY, OutputPolicy, check_cuda_opts, check_sentinel, default_ll_max_tokens, ll128_band
from .reference import normalize_lse_base

__all__ = ["BACKENDS", "KERNELS", "DTYPES", "MEMORIES", "Agreed", "agree_config"]

BACKENDS = ("auto", "direct", "a2a", "ag_rs")
KERNELS = ("auto", "cuda", "triton")
DTYPES = (torch.bfloat16, torch.float16)
MEMORIES = ("auto", "vmm", "symm", "host")


class Agreed(NamedTuple):
    """What the checks derive, the same on every rank: the LSE base ("e" | "2"), the device, the CUDA kernel's LL
    range, variants (sorted), LL128 band (max, min; (0, 0) = none) and sentinel (min tokens, split table in slice
    bytes; None = no call uses it)."""

    base: str
    device: torch.device
    ll_max_tokens: int
    cuda_opts: tuple[str, ...]
    ll128_max_tokens: int
    ll128_min_tokens: int
    sentinel: tuple[int, tuple] | None


def agree_config(
    info, *, max_tokens, heads_per_rank, head_dim, dtype, backend, memory, lse_base, timeout_s, device, kernel,
    programs, ll_max_tokens, ll128_max_tokens, policy,
) -> Agreed:  # fmt: skip
    """Check the arguments on this rank, gather every rank's problems and geometry, and raise the same
    TypeError / ValueError on every rank when any rank has a problem or the ranks disagree."""
    problems: list[tuple[type, str]] = []

    def need_int(name: str, v, lo: int, hi: int | None = None) -> None:
        if isinstance(v, bool) or not isinstance(v, int):
            problems.append((TypeError, f"{name} must be an int, got {type(v).__name__}"))
        elif v < lo or (hi is not None and v >= hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
            problems.append((ValueError, f"{name} must be {rng}, got {v}"))

    if not isinstance(policy, OutputPolicy):
        problems.append((TypeError, f"policy must be an OutputPolicy or None, got {type(policy).__name__}"))
        policy = DEFAULT_POLICY
    need_int("max_tokens", max_tokens, 1, K.TOKEN_SPACE)
    need_int("heads_per_rank", heads_per_rank, 1)
    need_int("head_dim", head_dim, 1)
    if programs is not None:
        need_int("programs", programs, 1)
    if ll_max_tokens is not None:
        need_int("ll_max_tokens", ll_max_tokens, 0)
    if ll128_max_tokens is not None:
        need_int("ll128_max_tokens", ll128_max_tokens, 0)
    if dtype not in DTYPES:
        problems.append((TypeError, f"dtype must be torch.bfloat16 or torch.float16, got {dtype}"))
    if backend not in BACKENDS:
        problems.append((ValueError, f"backend must be one of {BACKENDS}, got {backend!r}"))
    if memory not in MEMORIES:
        problems.append((ValueError, f"memory must be one of {MEMORIES}, got {memory!r}"))
    if kernel not in KERNELS:
        problems.append((ValueError, f"kernel must be one of {KERNELS}, got {kernel!r}"))
    try:
        base = normalize_lse_base(lse_base)
    except ValueError as e:
        problems.append((ValueError, str(e)))
        base = "e"
    bad_timeout = timeout_problem(timeout_s)
    if bad_timeout:
        problems.append((ValueError, bad_timeout))
    dev = None
    try:
        dev = resolve_device(device, cpu=memory == "host")
    except (ValueError, TypeError, RuntimeError) as e:
        problems.append((ValueError, f"device: {e}"))
    if dev is not None and memory in ("vmm", "symm") and dev.type != "cuda":
        problems.append((ValueError, f"memory={memory!r} needs a CUDA device, got {dev}"))
    if dev is not None and memory == "host" and dev.type != "cpu":
        problems.append((ValueError, f"memory='host' holds CPU tensors; device must be cpu, got {dev}"))
    if backend == "direct" and info.world_size < 2:
        problems.append((ValueError, "backend='direct' needs a group of at least 2 ranks"))
    ll = (
        default_ll_max_tokens(heads_per_rank, head_dim, dtype, policy=policy) if ll_max_tokens is None
        else ll_max_tokens
    )  # fmt: skip
    cuda_opts = check_cuda_opts(policy, problems)
    l128, l128_min = ll128_band(ll128_max_tokens, cuda_opts, max_tokens, ll, heads_per_rank, head_dim, policy=policy)
    sn = check_sentinel(policy, cuda_opts, max_tokens, problems)
    if l128 and l128 * K.ll128_lines(heads_per_rank, head_dim) * 8 * info.world_size >= 2**31:
        problems.append((ValueError, "LL128: ll128_max_tokens * heads too large (int32 lines); lower it"))
    geometry = (
        max_tokens, heads_per_rank, head_dim, str(dtype), backend, memory, base, kernel, programs, ll, cuda_opts,
        l128, l128_min, sn,
    )  # fmt: skip
    gathered = all_gather_object(info, (problems and [m for _, m in problems], geometry))
    if problems:
        exc_type = problems[0][0] if all(t is problems[0][0] for t, _ in problems) else ValueError
        raise exc_type("OutputReducer: " + "; ".join(m for _, m in problems))
    others = [(r, p) for r, (p, _) in enumerate(gathered) if p]
    if others:
        raise ValueError("OutputReducer: invalid arguments on " + "; ".join(f"rank {r}: {p}" for r, p in others))
    names = (
        "max_tokens", "heads_per_rank", "head_dim", "dtype", "backend", "memory", "lse_base", "kernel", "programs",
        "ll_max_tokens", "policy.cuda_opts", "ll128_max_tokens", "policy.cuda_ll128_min_tokens",
        "policy.cuda_sentinel_*",
    )  # fmt: skip
    diff = [n for i, n in enumerate(names) if len({g[1][i] for g in gathered}) != 1]
    if diff:
        detail = ", ".join(f"{n}: {[g[1][names.index(n)] for g in gathered]}" for n in diff)
        raise ValueError(f"OutputReducer: ranks disagree on {detail} (by rank)")
    return Agreed(base, dev, ll, cuda_opts, l128, l128_min, sn)
