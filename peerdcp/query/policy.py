"""Every tuning rule of the Query gather: one immutable :class:`QueryPolicy`, and the rules that apply it.

:data:`DEFAULT_POLICY` holds the defaults; :func:`default_policy` is what a :class:`~peerdcp.query.QueryGather`
built without ``policy=`` uses (the default with ``PEERDCP_QUERY_IMPL`` applied, read then, not at import). To
experiment, pass ``policy=dataclasses.replace(DEFAULT_POLICY, field=...)`` to the constructor (every rank the
same policy: it is agreed at construction).

What does not depend on the call is decided once, at construction (:func:`plan_direct`: a :class:`DirectPlan`);
what depends on T is decided per call by :func:`copy_mode`, :func:`launch_bits` and :func:`launch_blocks`, pure
functions of T and the plan, so every rank makes the same choice.

Figures: 2 x H200, ``bench.query``, 32 heads/rank, FP8 unless said, CUDA graph, µs per call (the full tables:
bench/RESULTS.md, Query gather). Byte bounds are bytes of finished rows per source, T * H * D * out-size; one
token's rows at 32 heads of nope 512 + rope 64 are ``_ROWS`` elements.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from . import kernels as K

__all__ = [
    "ByDtype",
    "QueryPolicy",
    "DEFAULT_POLICY",
    "default_policy",
    "DirectPlan",
    "plan_direct",
    "copy_mode",
    "launch_bits",
    "launch_blocks",
    "tuning_bytes",
    "AUTO_RAW_MAX_TOKENS",
    "AUTO_PUSH_RAW_MAX_TOKENS",
    "PUSH_AUTO_MAX_GROWTH",
]

_ROWS = 32 * 576  # one token's rows at 32 heads of nope 512 + rope 64, in elements
_GPU_IMPLS = ("cuda", "triton")


@dataclass(frozen=True)
class ByDtype:
    """A byte bound per output dtype (a plain int in a :class:`QueryPolicy` field applies to both)."""

    float8_e4m3fn: int
    bfloat16: int


@dataclass(frozen=True)
class QueryPolicy:
    """Tuning of the Query gather; every value is read at construction. Fields named ``cuda_*`` apply to the
    CUDA direct kernel only; ``*_max_bytes`` are byte bounds of a call's finished rows per source (an int, or
    :class:`ByDtype`), 0 = off. The flag-in-data protocols of a push call are tried in the order LL, SN, LL12,
    LL128 (each only up to the tokens its bound allows above the ones before it), else the fenced push (or,
    without push slots, raw / roped)."""

    # exchange="auto" on an object with push slots: raw for T <= this, else push. Push was fastest at every T, all
    # byte-exact: push / raw / roped 4.93 / 5.51 / 5.36 at T = 1, 24.85 / 43.68 / 27.20 at 256.
    auto_push_raw_max_tokens: int = 0
    # without push slots: raw bf16 shard for T <= this (shortest latency), else roped rows (FP8: half the NVLink
    # bytes). Raw / roped: 8.18 / 8.57 at T = 8, 11.26 / 10.06 at 32, 44.14 / 27.29 at 256.
    auto_raw_max_tokens: int = 8
    # exchange="auto" sizes slots 0/1 for push when a push slot (W * out-size / 2 raw slots) costs at most this
    # many raw slots: 1 = only where push is free (W = 2 FP8); W = 2 BF16 takes roped above the flag-in-data
    # bounds, where roped measured 0.4-1.2 µs faster than plain push at T = 32-128.
    push_auto_max_growth: float = 1
    # the direct kernel on a GPU with impl="auto" ("cuda" | "triton"; the benchmark compares both; default_policy
    # takes PEERDCP_QUERY_IMPL).
    gpu_impl: str = "cuda"
    # PDL launch for T <= this (0: off). With / without: 5.54 / 5.90 at T = 1, 9.40 / 9.89 at 32, but 12.31 / 11.35
    # at 64 and 17.76 / 15.49 at 128 (cause not measured).
    cuda_pdl_max_tokens: int = 32
    # LL (16-byte lines {data, flag, data, flag}: half the bytes are flags). Off: SN was faster at every T measured
    # (LL / SN 3.45 / 3.30 at T = 1, 4.23 / 4.00 at 8, 5.08 / 4.45 at 16).
    cuda_ll_max_bytes: int | ByDtype = ByDtype(0, 0)
    # LL12 (lines {3 data words, flag}). Below the SN bounds, so only reached with SN off: FP8 up to 128 tokens,
    # BF16 up to 48, where it beat LL, LL128 and the plain push (FP8 8.89 vs 11.02 / 11.15 / 11.45 at T = 64).
    cuda_ll12_max_bytes: int | ByDtype = ByDtype(128 * _ROWS, 48 * _ROWS * 2)
    # LL128 (128-byte lines of 15 data words + a flag word). Off: a fixed ~6.4 µs (6.43 vs 3.41 for LL at T = 1;
    # cause not found, csrc/query/flag_in_data.cuh).
    cuda_ll128_max_bytes: int | ByDtype = 0
    # SN, the sentinel push (no flag bytes; BF16 sends a 0xFFFF input half as 0x7FC0). Its area costs 2 * W * the
    # bound (W = 2, 32 heads, 256 tokens: 18.9 MB FP8, 37.7 MB BF16). SN vs LL <= 16 / LL12 <= 128 / fenced push:
    # 3.30 vs 3.45 at T = 1, 5.30 vs 6.06 at 32, 11.98 vs 15.54 at 128, 21.88 vs 24.28 at 256; BF16 vs LL12 <= 48 /
    # roped: 3.48 vs 3.80 at T = 1, 10.66 vs 14.49 at 64, 36.03 vs 42.62 at 256.
    cuda_sn_max_bytes: int | ByDtype = ByDtype(256 * _ROWS, 256 * _ROWS * 2)
    # grid of an object that uses SN, blocks per SM (capped by how many fit at once: interleaved FP8 takes 64
    # registers, so 4; NeoX 100, so 2); other objects keep 2 (LL / push kernels with 4 vs 2 per SM: 8.17 vs 6.06
    # at T = 32, 10.49 vs 8.85 at 64).
    cuda_sn_programs_per_sm: int = 4
    # SN calls launch with PDL at every T (else by cuda_pdl_max_tokens): with / without above T = 32: 7.26 / 7.74
    # at 64, 11.36 / 11.74 at 128, 21.85 / 22.35 at 256 (16 and 64 heads alike).
    cuda_sn_pdl: bool = True
    # SN calls above this publish pairs of words with one 16-byte store (interleaved RoPE, FP8; NeoX always 8-byte):
    # 16- / 8-byte 3.55 / 3.32 at T = 1, 7.24 / 7.30 at 64, 10.89 / 11.35 at 128, 19.68 / 21.76 at 256.
    cuda_sn_wide_min_bytes: int | ByDtype = 64 * _ROWS
    # an SN call launches ceil(T * H / this) blocks (0: the object's whole grid at every T). Whole grid / one unit
    # per block / two: 3.38 / 3.32 / 3.48 at T = 1, 4.09 / 3.94 / 3.83 at 8, 5.43 / 5.44 / 5.43 at 32.
    cuda_sn_units_per_block: int = 2
    # ... but at least min(T * H, this many per SM) blocks: fewer, fuller blocks pay at T = 4-24, a block per unit
    # at T <= 2, the whole grid from 32 tokens on (which the rule reaches there).
    cuda_sn_min_blocks_per_sm: int = 1
    # LL / SN push calls load their first round of inputs before the kernel's epoch / cos-sin barrier (with /
    # without: 3.49 / 3.58 at T = 1, 5.14 / 5.25 at 16).
    cuda_ll_early: bool = True

    def __post_init__(self) -> None:
        if self.gpu_impl not in _GPU_IMPLS:
            raise ValueError(f"QueryPolicy.gpu_impl must be one of {_GPU_IMPLS}, got {self.gpu_impl!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            bad = isinstance(v, bool) or not isinstance(v, (int, ByDtype))
            if f.name.endswith("_bytes") and bad:
                raise TypeError(f"QueryPolicy.{f.name} must be an int or a ByDtype, got {v!r}")

    def bytes_for(self, name: str, out_dtype: torch.dtype) -> int:
        """The byte bound ``name`` (a ``*_bytes`` field) for ``out_dtype``."""
        v = getattr(self, name)
        return int(getattr(v, str(out_dtype).removeprefix("torch.")) if isinstance(v, ByDtype) else v)


DEFAULT_POLICY = QueryPolicy()

# The defaults' values under their former module names (peerdcp.query exports the first two).
AUTO_RAW_MAX_TOKENS = DEFAULT_POLICY.auto_raw_max_tokens
AUTO_PUSH_RAW_MAX_TOKENS = DEFAULT_POLICY.auto_push_raw_max_tokens
PUSH_AUTO_MAX_GROWTH = DEFAULT_POLICY.push_auto_max_growth


def default_policy() -> QueryPolicy:
    """:data:`DEFAULT_POLICY` with ``PEERDCP_QUERY_IMPL`` (if set) as its ``gpu_impl``: read at each call."""
    impl = os.environ.get("PEERDCP_QUERY_IMPL")
    return DEFAULT_POLICY if impl is None else dataclasses.replace(DEFAULT_POLICY, gpu_impl=impl)


def tuning_bytes(key: str, out_dtype: torch.dtype, *, policy: QueryPolicy | None = None) -> int:
    """``policy``'s byte bound ``key`` (e.g. ``"cuda_sn_max_bytes"``) for ``out_dtype`` (None: the default)."""
    return (policy or DEFAULT_POLICY).bytes_for(key, out_dtype)


@dataclass(frozen=True)
class DirectPlan:
    """What the direct backend decided at construction (the same on every rank): the token bounds of each
    flag-in-data protocol (0: never), the sizes of their areas, and the per-call launch rules' inputs."""

    exchange: str
    push_slots: bool = False  # slots 0/1 hold push regions
    ll_max: int = 0  # the most tokens a call sends by LL / SN / LL12 / LL128 (see copy_mode)
    sn_max: int = 0
    ll12_max: int = 0
    ll128_max: int = 0
    ll_area: int = 0  # tokens the LL area (LL and LL12 calls) holds per (parity, source)
    ll128_lines: int = 0  # 128-byte lines per (parity, source) of the LL128 area
    sn_wide_min: int | None = None  # SN calls with T above it use 16-byte stores (None: never)
    early: bool = False  # LL / SN push calls load their first inputs early
    pdl_max: int = 0  # PDL for T <= this
    sn_pdl: bool = False  # PDL on every SN call
    sn_upb: int = 0  # an SN call's grid: ceil(T * H / this) blocks (0: the whole grid)


def plan_direct(
    policy: QueryPolicy,
    *,
    exchange: str,
    impl: str,
    world_size: int,
    heads: int,
    head_dim: int,
    max_tokens: int,
    out_dtype: torch.dtype,
    rope_style: str,
) -> tuple[DirectPlan, list[str]]:
    """The direct backend's construction-time choices, and the reasons to report (``QueryGather.reason``)."""
    cuda = impl == "cuda"
    growth = world_size * out_dtype.itemsize / 2  # push slot / raw slot
    bound = dict(ll=0, sn=0, ll12=0, ll128=0)
    sn_wide_min = None
    if exchange in ("auto", "push") and cuda:  # the LL areas need no push slots
        row_bytes = heads * head_dim * out_dtype.itemsize  # one token's finished rows
        for k in bound:
            bound[k] = min(max_tokens, policy.bytes_for(f"cuda_{k}_max_bytes", out_dtype) // row_bytes)
        if head_dim * out_dtype.itemsize % 24:  # LL12 moves whole 24-byte triples of a row
            bound["ll12"] = 0
        # each protocol only above the ones before it (a bound at or below an earlier one is never reached)
        bound["sn"] = bound["sn"] if bound["sn"] > bound["ll"] else 0
        if bound["sn"] and rope_style == "interleaved" and out_dtype == torch.float8_e4m3fn:
            sn_wide_min = policy.bytes_for("cuda_sn_wide_min_bytes", out_dtype) // row_bytes
        below = max(bound["ll"], bound["sn"])
        bound["ll12"] = bound["ll12"] if bound["ll12"] > below else 0
        bound["ll128"] = bound["ll128"] if bound["ll128"] > max(below, bound["ll12"]) else 0
    ll128_lines = 0
    if bound["ll128"]:
        ll128_lines = -(-(bound["ll128"] * heads * head_dim * out_dtype.itemsize // 8) // 15)  # 15 data words a line
    plan = DirectPlan(
        exchange=exchange,
        push_slots=exchange == "push" or (exchange == "auto" and growth <= policy.push_auto_max_growth),
        ll_max=bound["ll"],
        sn_max=bound["sn"],
        ll12_max=bound["ll12"],
        ll128_max=bound["ll128"],
        ll_area=max(bound["ll"], bound["ll12"]),
        ll128_lines=ll128_lines,
        sn_wide_min=sn_wide_min,
        early=bool(policy.cuda_ll_early),
        pdl_max=int(policy.cuda_pdl_max_tokens) if cuda else 0,
        sn_pdl=bool(policy.cuda_sn_pdl),
        sn_upb=int(policy.cuda_sn_units_per_block),
    )
    return plan, _plan_reasons(plan, policy)


def _plan_reasons(plan: DirectPlan, policy: QueryPolicy) -> list[str]:
    reasons = []
    if plan.pdl_max:
        reasons.append(f"PDL launch for T <= {plan.pdl_max}")
    if plan.push_slots:
        raw_max = policy.auto_push_raw_max_tokens
        rule = f"raw for T <= {raw_max}, else push" if raw_max else "push"
    else:
        rule = f"raw for T <= {policy.auto_raw_max_tokens}, else roped"
    lls = [("LL", plan.ll_max), ("SN", plan.sn_max), ("LL12", plan.ll12_max), ("LL128", plan.ll128_max)]
    ll_rule = ", ".join(f"{n} push for T <= {b}" for n, b in lls if b)
    if ll_rule:
        rule = ll_rule + ", then " + rule
    reasons.append(f"exchange {plan.exchange}" + (f" ({rule})" if plan.exchange == "auto" else ""))
    if plan.sn_wide_min is not None and plan.sn_wide_min < plan.sn_max:
        reasons.append(f"SN calls with T > {plan.sn_wide_min} store 16 bytes per thread")
    if ll_rule and plan.exchange == "push":
        reasons.append(ll_rule.replace(" push", " protocol"))
    return reasons


def copy_mode(
    exchange: str,
    tokens: int,
    *,
    push_slots: bool,
    ll_max: int,
    ll12_max: int = 0,
    ll128_max: int = 0,
    sn_max: int = 0,
    policy: QueryPolicy | None = None,
) -> int:
    """The direct kernel's mode (``kernels.MODE_*``) for a copy call of ``tokens`` >= 1 tokens: a pure
    function of the call's size and of what every rank agreed on at construction, so every rank picks the
    same mode.

    ``exchange``: the object's exchange; ``push_slots``: its parity slots hold push regions; ``ll_max`` /
    ``sn_max`` / ``ll12_max`` / ``ll128_max``: the most tokens its CUDA kernel sends by the LL / SN (sentinel)
    / LL12 / LL128 protocol (0: none, e.g. the Triton kernel); each applies above the ones before it, in that
    order. ``policy``: its ``auto_*`` rules (None: the default).
    """
    policy = policy or DEFAULT_POLICY
    if exchange in ("auto", "push"):
        if exchange == "auto" and push_slots and tokens <= policy.auto_push_raw_max_tokens:
            return K.MODE_RAW
        for bound, mode in (
            (ll_max, K.MODE_PUSH_LL),
            (sn_max, K.MODE_PUSH_SN),
            (ll12_max, K.MODE_PUSH_LL12),
            (ll128_max, K.MODE_PUSH_LL128),
        ):
            if tokens <= bound:
                return mode
        if exchange == "push" or push_slots:
            return K.MODE_PUSH
        return K.MODE_RAW if tokens <= policy.auto_raw_max_tokens else K.MODE_ROPED
    return {"raw": K.MODE_RAW, "roped": K.MODE_ROPED}[exchange]


def launch_bits(plan: DirectPlan, mode: int, tokens: int) -> int:
    """The CUDA kernel's mode bits for a call of ``mode`` with ``tokens`` tokens (local to a rank): PDL for
    T <= ``pdl_max`` and on every SN call with ``sn_pdl``; the wide bit on SN calls above ``sn_wide_min`` (no
    early load: the SN16 kernel loads pairs), else the early bit on LL / SN calls with ``early``."""
    bits = K.MODE_PDL if plan.pdl_max >= tokens or (mode == K.MODE_PUSH_SN and plan.sn_pdl) else 0
    if mode == K.MODE_PUSH_SN and plan.sn_wide_min is not None and plan.sn_wide_min < tokens:
        bits |= K.MODE_WIDE
    elif mode in (K.MODE_PUSH_LL, K.MODE_PUSH_SN) and plan.early:
        bits |= K.MODE_EARLY
    return bits


def launch_blocks(mode: int, tokens: int, heads: int, num_programs: int, units_per_block: int, min_blocks: int) -> int:
    """The CUDA grid of a call. An SN call with ``units_per_block`` > 0 (``cuda_sn_units_per_block``)
    launches ceil(tokens * heads / units_per_block) blocks, but at least min(tokens * heads, ``min_blocks``)
    (``cuda_sn_min_blocks_per_sm`` times the SMs) and at most the object's ``num_programs``; every other call
    (and SN with 0) launches the object's grid."""
    if mode != K.MODE_PUSH_SN or units_per_block <= 0:
        return num_programs
    units = tokens * heads
    return min(num_programs, max(-(-units // units_per_block), min(units, min_blocks)))


def sn_programs_per_sm(policy: QueryPolicy, resident: int) -> int:
    """Blocks per SM of an object whose copy calls use SN: the policy's, capped by ``resident`` (how many fit at
    once), but never below the 2 every other object uses."""
    return max(2, min(int(policy.cuda_sn_programs_per_sm), resident))
