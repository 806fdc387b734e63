"""Every tuning rule of the Output/LSE exchange: one immutable :class:`OutputPolicy`, and the rules that apply it.

:data:`DEFAULT_POLICY` holds the defaults; :func:`default_policy` is what an :class:`~peerdcp.output.OutputReducer`
built without ``policy=`` uses (the default with ``PEERDCP_OUTPUT_KERNEL`` applied, read then, not at import). To
experiment, pass ``policy=dataclasses.replace(DEFAULT_POLICY, field=...)`` to the constructor (every rank the same
policy: the fields that shape the kernel are agreed at construction, and a bad value is reported on every rank).

Everything here is decided once, at construction; what depends on T (the LL / LL128 / sentinel choice and the
sentinel kernel's publisher split) is fixed then as token thresholds (:func:`default_ll_max_tokens`,
:func:`ll128_band`, :func:`sentinel_split_tokens`) that the launcher compares T with, the same on every rank.

Figures: W = 2 (2 x H200), ``bench.output``, PDL, CUDA graph, µs per call (the full tables: bench/RESULTS.md,
Output/LSE). Kimi is 16 heads/rank x 512 bf16 (16 KiB per token); DeepSeek 32 heads/rank.
"""

from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import dataclass

import torch

from .._runtime.checks import is_int

__all__ = [
    "OutputPolicy",
    "DEFAULT_POLICY",
    "default_policy",
    "CUDA_OPTS",
    "default_ll_max_tokens",
    "ll128_band",
    "sentinel_split_tokens",
    "triton_unit_elems",
    "check_cuda_opts",
    "check_sentinel",
    "DIRECT_KERNEL_DEFAULT",
    "TUNING",
]

# The CUDA kernel's variant names, = peerdcp.output.ops.OPTS (not imported from there: ops loads the CUDA build).
CUDA_OPTS = ("tight_grid", "early_load", "pdl", "ll128", "chunked", "split_roles", "sentinel")
# Pairs of variants that exclude each other (the C entry point refuses them too).
_EXCLUSIVE = (
    ("ll128", "tight_grid"), ("ll128", "chunked"), ("chunked", "early_load"), ("sentinel", "tight_grid"),
    ("sentinel", "chunked"),
)  # fmt: skip


@dataclass(frozen=True)
class OutputPolicy:
    """Tuning of the Output/LSE exchange; every value is read at construction and is the same on every rank (the
    grid never depends on T). Fields named ``cuda_*`` apply to the CUDA direct kernel only."""

    # the direct kernel that kernel="auto" uses on CUDA ("cuda"; anything else: the Triton twin). bench/output.py
    # measures both; default_policy takes PEERDCP_OUTPUT_KERNEL.
    direct_kernel: str = "cuda"
    # CUDA kernel grid: G = min(this, co-resident CTAs per SM) * SMs.
    cuda_programs_per_sm: int = 2
    # Triton kernel grid on a GPU: G = this * SMs (one 4-warp program per SM always fits).
    triton_programs_per_sm: int = 1
    # elements per (token, head chunk) work unit of the Triton kernels on a GPU.
    triton_unit_elems_gpu: int = 1024
    # ... under the interpreter (tiny test shapes).
    triton_unit_elems_cpu: int = 32
    # G under TRITON_INTERPRET=1 (the interpreter runs the programs one after another).
    interpreter_programs: int = 3
    # LL protocol (the flag inside every 8-byte word) for T <= this, while the slice per destination stays within
    # cuda_ll_max_bytes.
    cuda_ll_max_tokens: int = 8
    # LL's bound on the slice per destination (T * heads * D * element bytes); LL sends twice the bytes. LL vs the
    # next kernel at 16 heads x 512 bf16: faster to T = 4 (3.70 vs 3.99), slower at 8 (4.51 vs 4.30); at 32 heads
    # faster to T = 2, slower at 4 (4.45 / 4.27) and 8 (5.96 / 4.66): LL wins up to 64 KiB per destination.
    cuda_ll_max_bytes: int = 65536
    # LL128 (flags inside 128-byte lines; csrc/output/direct.cu says what it assumes) for cuda_ll_max_tokens < T <=
    # this; 0: off. Off because the sentinel kernel is faster in LL128's band (Kimi: 5.5 vs 6.5 at T = 24), where
    # LL128 beats the plain kernel (24 <= T <= 48: this = 48 with the minimum below is its best band).
    cuda_ll128_max_tokens: int = 0
    # LL128 band only: calls with T <= this use LL / the plain kernel.
    cuda_ll128_min_tokens: int = 20
    # CUDA kernel variants (names of CUDA_OPTS; agreed by every rank): "tight_grid" (launch only the CTAs that own
    # a unit), "early_load" (input loads overlap the epoch read), "pdl" (programmatic dependent launch: 0.3-0.5
    # faster at every T, A/B in one benchmark process), "ll128" (every T above LL on LL128, NCCL's protocol),
    # "chunked" (above LL: the plain protocol released per chunk of units by a signalling warp, so the combine
    # overlaps the transfer), "split_roles" (with "chunked": separate publishing and combining warps), "sentinel"
    # (T > cuda_sentinel_min_tokens: the inbox holds a reserved 16-bit pattern at rest, so every vector signals its
    # own arrival: 1.0-1.6 faster than the plain kernel for 12 <= T <= 64, with split roles 1.8-3.5 for T >= 96).
    # () is the plain kernel above the LL range.
    cuda_opts: tuple[str, ...] = ("pdl", "sentinel")
    # with "sentinel": calls with T > this use the sentinel kernel (LL and an LL128 band take precedence).
    cuda_sentinel_min_tokens: int = 0
    # with "sentinel": ((b, n, u), ...), b increasing: a call whose slice per destination (T * H * D * element
    # bytes) exceeds b (the last such entry) lets the first n CTAs publish, u (1 or 2) 16-byte loads in flight per
    # thread, while the others combine under the transfer; at or below the first b every CTA publishes its share
    # (2 loads in flight), then combines it. Kimi: every CTA both to T = 16 (256 KiB; at T = 24-64 40 x 1 is 5-10 %
    # faster: T = 64 6.93 vs 7.62); 40 x 1 to T = 160 (2.5 MiB; T = 128: 9.84-9.92 vs 10.33 with 36 x 2); 36 x 2 to
    # T = 224 (T = 192: 13.44; 40 x 2: 14.61); 40 x 2 to 6 MiB (T = 256: 16.9-17.1; 36 x 2: 17.5); 44 x 2 above
    # (8 MiB: 29.4 vs 31.2 with 40 x 2). The optimum is sharp in n. In bytes, not tokens: DeepSeek measured the
    # same as Kimi at the same bytes (4 MiB: 17.03 / 17.03; 8 MiB: 29.37 / 29.44 with 44 x 2). () = never split.
    cuda_sentinel_split: tuple[tuple[int, int, int], ...] = (
        (1 << 18, 40, 1), (5 << 19, 36, 2), (7 << 19, 40, 2), (3 << 21, 44, 2),
    )  # fmt: skip


DEFAULT_POLICY = OutputPolicy()

# The defaults under their former module names, read-only (peerdcp.output exports them): the direct kernel of
# kernel="auto" without PEERDCP_OUTPUT_KERNEL, and the former TUNING dict's entries.
DIRECT_KERNEL_DEFAULT = DEFAULT_POLICY.direct_kernel
TUNING = types.MappingProxyType({k: v for k, v in dataclasses.asdict(DEFAULT_POLICY).items() if k != "direct_kernel"})


def default_policy() -> OutputPolicy:
    """:data:`DEFAULT_POLICY` with ``PEERDCP_OUTPUT_KERNEL`` (if set) as its ``direct_kernel``: read at each call."""
    kernel = os.environ.get("PEERDCP_OUTPUT_KERNEL")
    return DEFAULT_POLICY if kernel is None else dataclasses.replace(DEFAULT_POLICY, direct_kernel=kernel)


def default_ll_max_tokens(
    heads_per_rank: int, head_dim: int, dtype: torch.dtype, *, policy: OutputPolicy | None = None
) -> int:
    """The CUDA kernel's default LL range (calls with ``T <=`` it use LL): ``policy.cuda_ll_max_tokens``, cut so
    that a call's slice per destination, ``T * heads_per_rank * head_dim * element bytes``, stays within
    ``policy.cuda_ll_max_bytes`` (16 heads x 512 bf16: 4 tokens; 32 heads: 2; 8 heads: 8). Arguments that are not
    positive ints give the token bound alone (the constructor reports them). ``policy`` None: the default."""
    policy = policy or DEFAULT_POLICY
    cap = int(policy.cuda_ll_max_tokens)
    size = getattr(dtype, "itemsize", 2)
    if any(not is_int(v) or v < 1 for v in (heads_per_rank, head_dim)):
        return cap
    return min(cap, int(policy.cuda_ll_max_bytes) // (heads_per_rank * head_dim * size))


def ll128_band(
    ll128_max_tokens, cuda_opts: tuple, max_tokens, ll_max_tokens, heads_per_rank, head_dim,
    *, policy: OutputPolicy | None = None,
) -> tuple[int, int]:  # fmt: skip
    """(max, min) of the CUDA kernel's LL128 band: calls with ``max(ll_max_tokens, min) < T <= max`` use LL128.
    (0, 0) when no call would: LL128 off, a band at or below the LL range, ``tight_grid`` (LL128 runs every
    CTA in every call) or ``chunked`` (which replaces it); the ``"ll128"`` option makes it every T above the LL
    range. ``ll128_max_tokens`` None: ``policy.cuda_ll128_max_tokens``. Arguments as given to OutputReducer
    (possibly invalid: then (0, 0); they are reported elsewhere)."""
    policy = policy or DEFAULT_POLICY
    hi = policy.cuda_ll128_max_tokens if ll128_max_tokens is None else ll128_max_tokens
    lo = policy.cuda_ll128_min_tokens
    if "ll128" in cuda_opts:
        hi, lo = max_tokens, 0
    elif "tight_grid" in cuda_opts or "chunked" in cuda_opts:
        hi = 0
    if not all(is_int(v) for v in (hi, lo, max_tokens, ll_max_tokens)):
        return 0, 0
    if not all(is_int(v) for v in (heads_per_rank, head_dim)):
        return 0, 0
    hi = min(hi, max_tokens)
    if hi <= max(ll_max_tokens, lo):  # the band is empty
        return 0, 0
    return hi, lo


def sentinel_split_tokens(table, bytes_per_token: int, programs: int) -> tuple:
    """``policy.cuda_sentinel_split`` (slice-byte thresholds) as the launcher's token thresholds:
    ``T > b // bytes_per_token`` exactly when ``T * bytes_per_token > b``; a publisher count of at least the
    grid (``programs``) means every CTA publishes and combines (0)."""
    return tuple((b // bytes_per_token, n if n < programs else 0, u) for b, n, u in table)


def triton_unit_elems(policy: OutputPolicy, gpu: bool) -> int:
    """Elements per work unit of the Triton kernels (on a GPU, or under the interpreter)."""
    return policy.triton_unit_elems_gpu if gpu else policy.triton_unit_elems_cpu


def check_cuda_opts(policy: OutputPolicy, problems: list[tuple[type, str]]) -> tuple[str, ...]:
    """``policy.cuda_opts`` sorted, or () if it is not a collection of :data:`CUDA_OPTS` names; every fault
    (unknown names, exclusive pairs, ``split_roles`` without ``chunked``) appended to ``problems``."""
    cuda_opts = policy.cuda_opts
    if not isinstance(cuda_opts, (tuple, list, set, frozenset)) or not all(o in CUDA_OPTS for o in cuda_opts):
        problems.append((ValueError, f"policy.cuda_opts must be a tuple of names from {CUDA_OPTS}, got {cuda_opts!r}"))
        cuda_opts = ()
    cuda_opts = tuple(sorted(set(cuda_opts)))
    for a, b in _EXCLUSIVE:
        if a in cuda_opts and b in cuda_opts:
            problems.append((ValueError, f"policy.cuda_opts: {a!r} and {b!r} exclude each other"))
    if "split_roles" in cuda_opts and "chunked" not in cuda_opts:
        problems.append((ValueError, "policy.cuda_opts: 'split_roles' applies to 'chunked' only"))
    return cuda_opts


def _split_table_ok(table) -> bool:
    """``policy.cuda_sentinel_split``: a tuple of (byte threshold, publisher CTAs, loads in flight) int
    triples, thresholds increasing, loads 1 or 2."""
    if not isinstance(table, (tuple, list)):
        return False
    last = -1
    for entry in table:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            return False
        if any(not is_int(v) or v < 0 for v in entry) or entry[0] <= last:
            return False
        if entry[2] not in (1, 2):
            return False
        last = entry[0]
    return True


def check_sentinel(
    policy: OutputPolicy, cuda_opts: tuple[str, ...], max_tokens, problems: list[tuple[type, str]]
) -> tuple[int, tuple] | None:
    """The sentinel kernel's (min tokens, split table) from ``policy``, or None when no call would use it (no
    ``"sentinel"`` in ``cuda_opts``, or a minimum at or above ``max_tokens``); faults appended to ``problems``."""
    sn = (policy.cuda_sentinel_min_tokens, policy.cuda_sentinel_split)
    if not is_int(sn[0]) or sn[0] < 0:
        problems.append((ValueError, f"policy.cuda_sentinel_min_tokens must be an int >= 0, got {sn[0]!r}"))
    if not _split_table_ok(sn[1]):
        problems.append(
            (ValueError, "policy.cuda_sentinel_split must be ((bytes, publishers, loads), ...) ints >= 0 "
             f"with bytes increasing and loads 1 or 2, got {sn[1]!r}")
        )  # fmt: skip
        sn = (sn[0], ())
    sn = (sn[0], tuple(tuple(entry) for entry in sn[1]))
    if "sentinel" not in cuda_opts or not isinstance(sn[0], int) or sn[0] >= max_tokens:
        return None  # no call would use it
    return sn
