"""`QueryGather`: the widened MLA query of a DCP group, gathered and rotated in one fused kernel.

Lifecycle (every step collective over the group, in the same order on every rank):

1. ``qg = QueryGather(group, max_tokens=..., heads_per_rank=...)`` - before any CUDA-graph capture:
   agrees on the geometry, picks the backend / memory / kernel and allocates the exposed buffer.
2. Per decode step and layer, either

   * ``q = qg.gather(q_nope, q_pe, positions, cos_sin_cache)`` (the kernel copies or rotates this
     rank's shard into its exposed buffer itself), or
   * zero-copy: ``q_nope_buf, q_pe_buf = qg.exposed_shard(T)``; the model writes its projection
     straight into these views; ``q = qg.gather_exposed(positions, cos_sin_cache)``.

   Both are capturable in CUDA graphs and may run back to back with changing inputs: there is no host
   synchronization (a device-side call counter selects the parity slot; see ``kernels.py``).
3. ``qg.check()`` whenever convenient (raises :class:`peerdcp.PeerTimeoutError` if a peer stopped
   answering); ``qg.close()`` (collective, idempotent), or use the object as a context manager.

.. important::
   All ranks must make the same sequence of calls with the same T, on one stream per rank (the one
   current at the call). A rank that stops calling makes its peers' waits time out after
   ``timeout_s``: they raise ``PeerTimeoutError`` at their next call (on CPU: at once) and the object
   refuses every call after that; re-create it.
"""

from __future__ import annotations

import os

import torch
import triton

from .. import memory as _memory
from .._runtime.checks import is_int, resolve_device, timeout_problem
from .._runtime.device import ErrorWord, mechanism_code, num_sms, on_gpu, spin_budget
from .._runtime.groups import agree, agree_or_release, all_gather_object, bounded_collective, resolve_group
from .._runtime.lifecycle import Collective
from ..errors import PeerSetupError, PeerTimeoutError
from . import kernels as K
from .reference import ROPE_STYLES, widened_query

__all__ = [
    "QueryGather",
    "copy_mode",
    "tuning_bytes",
    "BACKENDS",
    "IMPLS",
    "EXCHANGES",
    "AUTO_RAW_MAX_TOKENS",
    "AUTO_PUSH_RAW_MAX_TOKENS",
]

BACKENDS = ("auto", "direct", "allgather")
IMPLS = ("auto", "cuda", "triton", "torch")
EXCHANGES = ("auto", "raw", "roped", "push")
OUT_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
# The figures below: 2 x H200, bench.query, 32 heads/rank, FP8 unless said, CUDA graph, us per call (the full
# tables: bench/RESULTS.md, Query gather).
# exchange="auto" on an object with push slots (below): "push" for T > AUTO_PUSH_RAW_MAX_TOKENS, else raw. Push
# was fastest at every T, all byte-exact: push / raw / roped 4.93 / 5.51 / 5.36 at T = 1, 24.85 / 43.68 / 27.20
# at 256.
AUTO_PUSH_RAW_MAX_TOKENS = 0
# Without push slots: T <= AUTO_RAW_MAX_TOKENS moves the raw bf16 shard (the producer only copies before it
# signals: shortest latency); larger T moves rows the producer already rotated and converted (FP8: half the
# NVLink bytes). Raw / roped: 8.18 / 8.57 at T = 8, 11.26 / 10.06 at 32, 44.14 / 27.29 at 256.
AUTO_RAW_MAX_TOKENS = 8
# exchange="auto" sizes slots 0/1 for push when that costs at most PUSH_AUTO_MAX_GROWTH times a raw slot (a
# push slot holds W sources' rows of the out dtype: W * out-size / 2 raw slots; 1x for W = 2 FP8). 1: only
# where push is free. W = 2 BF16 (2x) takes roped above the flag-in-data bounds (below), where roped measured
# 0.4-1.2 us faster than plain push at T = 32-128.
PUSH_AUTO_MAX_GROWTH = 1
# the kernel the direct backend uses on a GPU when impl="auto" (the benchmark compares both)
DEFAULT_GPU_IMPL = os.environ.get("PEERDCP_QUERY_IMPL", "cuda")
# read at construction: calls with T <= "cuda_pdl_max_tokens" launch the CUDA direct kernel with
# programmatic dependent launch (the next call's launch overlaps this one's tail; csrc/query/direct.cu says
# why the protocol is unchanged); 0 turns it off. With / without PDL: 5.54 / 5.90 at T = 1, 9.40 / 9.89 at 32,
# but 12.31 / 11.35 at 64 and 17.76 / 15.49 at 128 (cause not measured).
# Push calls with the CUDA kernel move their finished rows by a flag-in-data protocol when they fit (no fence,
# no ready flag; read at construction, bytes of finished rows per source = T * H * D * out-size, an int or a
# dict by out dtype name, 0 = off), tried in this order, else by the fenced push (or, without push slots, raw /
# roped); a protocol is used only up to the tokens its bound allows above the ones before it:
# "cuda_ll_max_bytes": LL - 16-byte lines {data, flag, data, flag}, half the bytes are flags. Off: SN was
#   faster at every T it was measured at (LL / SN 3.45 / 3.30 at T = 1, 4.23 / 4.00 at 8, 5.08 / 4.45 at 16).
# "cuda_sn_max_bytes": SN, the sentinel push - every 8 output bytes travel as they are and replace a rest
#   pattern in the peer's sentinel area, which the consumer puts back (csrc/query/flag_in_data.cuh): no flag bytes at
#   all. BF16: a 0xFFFF half (a NaN the input may carry) is sent as the canonical NaN 0x7FC0 - the one case
#   where its bytes differ from the other exchanges'. Its area costs 2 * W * the bound in bytes (W = 2, 32
#   heads, 256 tokens: 18.9 MB FP8, 37.7 MB BF16). SN at every T against LL <= 16 / LL12 <= 128 / fenced push:
#   3.30 vs 3.45 at T = 1, 5.30 vs 6.06 at 32, 11.98 vs 15.54 at 128, 21.88 vs 24.28 at 256; BF16 against
#   LL12 <= 48 / roped: 3.48 vs 3.80 at T = 1, 10.66 vs 14.49 at 64, 36.03 vs 42.62 at 256.
# "cuda_ll12_max_bytes": LL12 - lines {3 data words, flag}: a quarter are flags. Below the SN bounds, so with
#   these defaults only an object with SN turned off uses it (FP8 up to 128 tokens, BF16 up to 48: where it
#   beat LL, LL128 and the plain push, e.g. FP8 8.89 vs 11.02 / 11.15 / 11.45 at T = 64).
# "cuda_ll128_max_bytes": LL128 - 128-byte lines of 15 data words + a flag word. Off: it costs a fixed ~6.4 us
#   (6.43 vs 3.41 for LL at T = 1; cause not found, csrc/query/flag_in_data.cuh).
# "cuda_sn_programs_per_sm": the grid of an object that uses SN, blocks per SM (capped by how many fit at
#   once: the interleaved FP8 kernel takes 64 registers, so 4; NeoX 100, so 2); other objects keep 2 (the LL /
#   push kernels with 4 per SM vs 2: 8.17 vs 6.06 at T = 32, 10.49 vs 8.85 at 64).
# "cuda_sn_pdl": SN calls launch with PDL at every T (else by "cuda_pdl_max_tokens"): with / without above
#   T = 32: 7.26 / 7.74 at 64, 11.36 / 11.74 at 128, 21.85 / 22.35 at 256 (16 and 64 heads alike).
# "cuda_sn_wide_min_bytes": SN calls above this many bytes per source publish pairs of words with one 16-byte
#   store per thread (interleaved RoPE only; NeoX calls always 8-byte): 16- / 8-byte 3.55 / 3.32 at T = 1,
#   7.24 / 7.30 at 64, 10.89 / 11.35 at 128, 19.68 / 21.76 at 256.
# "cuda_sn_units_per_block" / "cuda_sn_min_blocks_per_sm": an SN call launches ceil(T * H / 2) blocks, but at
#   least min(T * H, one per SM), not the object's whole grid (sized for 256 tokens: 4 per SM); the object's
#   call counters still count every call (csrc/query/params.cuh, enter_call). Whole grid / one unit per
#   block / two: 3.38 / 3.32 / 3.48 at T = 1, 4.09 / 3.94 / 3.83 at 8, 5.43 / 5.44 / 5.43 at 32: fewer, fuller
#   blocks pay at T = 4-24, a block per unit at T <= 2, the whole grid from 32 tokens on (which this rule
#   reaches there). 0: the whole grid at every T.
# "cuda_ll_early": LL / SN push calls load their first round of inputs before the kernel's epoch / cos-sin
#   barrier (with / without: 3.49 / 3.58 at T = 1, 5.14 / 5.25 at 16).
_ROWS = 32 * 576  # one token's rows at 32 heads of nope 512 + rope 64, in elements
TUNING = {
    "cuda_pdl_max_tokens": 32,
    "cuda_ll_max_bytes": {"float8_e4m3fn": 0, "bfloat16": 0},
    "cuda_ll12_max_bytes": {"float8_e4m3fn": 128 * _ROWS, "bfloat16": 48 * _ROWS * 2},
    "cuda_ll128_max_bytes": 0,
    "cuda_sn_max_bytes": {"float8_e4m3fn": 256 * _ROWS, "bfloat16": 256 * _ROWS * 2},
    "cuda_sn_programs_per_sm": 4,
    "cuda_sn_pdl": True,
    "cuda_sn_wide_min_bytes": 64 * _ROWS,
    "cuda_sn_units_per_block": 2,
    "cuda_sn_min_blocks_per_sm": 1,
    "cuda_ll_early": True,
}


def launch_blocks(mode: int, tokens: int, heads: int, num_programs: int, units_per_block: int, min_blocks: int) -> int:
    """The CUDA grid of a call. An SN call with ``units_per_block`` > 0 (``TUNING["cuda_sn_units_per_block"]``)
    launches ceil(tokens * heads / units_per_block) blocks, but at least min(tokens * heads, ``min_blocks``)
    (``TUNING["cuda_sn_min_blocks_per_sm"]`` times the SMs) and at most the object's ``num_programs``; every
    other call (and SN with 0) launches the object's grid."""
    if mode != K.MODE_PUSH_SN or units_per_block <= 0:
        return num_programs
    units = tokens * heads
    return min(num_programs, max(-(-units // units_per_block), min(units, min_blocks)))


def tuning_bytes(key: str, out_dtype: torch.dtype) -> int:
    """``TUNING[key]`` for ``out_dtype``: the entry itself (an int for every dtype) or its value for the
    dtype's name (``"float8_e4m3fn"`` / ``"bfloat16"``)."""
    v = TUNING[key]
    return int(v[str(out_dtype).removeprefix("torch.")] if isinstance(v, dict) else v)


def copy_mode(
    exchange: str,
    tokens: int,
    *,
    push_slots: bool,
    ll_max: int,
    ll12_max: int = 0,
    ll128_max: int = 0,
    sn_max: int = 0,
) -> int:
    """The direct kernel's mode (``kernels.MODE_*``) for a copy call of ``tokens`` >= 1 tokens: a pure
    function of the call's size and of what every rank agreed on at construction, so every rank picks the
    same mode.

    ``exchange``: the object's exchange; ``push_slots``: its parity slots hold push regions; ``ll_max`` /
    ``sn_max`` / ``ll12_max`` / ``ll128_max``: the most tokens its CUDA kernel sends by the LL / SN (sentinel)
    / LL12 / LL128 protocol (0: none, e.g. the Triton kernel); each applies above the ones before it, in that
    order.
    """
    if exchange in ("auto", "push"):
        if exchange == "auto" and push_slots and tokens <= AUTO_PUSH_RAW_MAX_TOKENS:
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
        return K.MODE_RAW if tokens <= AUTO_RAW_MAX_TOKENS else K.MODE_ROPED
    return {"raw": K.MODE_RAW, "roped": K.MODE_ROPED}[exchange]


class QueryGather(Collective):
    """Gather every rank's query heads of a DCP group, apply RoPE and convert, in one fused kernel.

    Args:
        group: ``torch.distributed`` ProcessGroup (None: the default group). W = its size.
        max_tokens: the largest T a call may pass (sizes the exposed buffer).
        heads_per_rank: H, this rank's query heads (the same on every rank).
        nope_dim: width of ``q_nope`` (512: the absorbed latent).  rope_dim: width of ``q_pe`` (64, even).
        rope_style: ``"interleaved"`` (GPT-J pairs; MLA) or ``"neox"`` (half split).
        out_dtype: ``torch.float8_e4m3fn`` (saturating, ``quant_scale`` applied) or ``torch.bfloat16``.
        quant_scale: per-tensor multiplier before the FP8 cast (must be 1.0 for bf16 output).
        backend: ``"direct"`` (peer memory: see ``exchange``; SGLang's ``vmm_direct``),
            ``"allgather"`` (all-gather of the bf16 shards, then one fused RoPE + convert kernel), or
            ``"auto"`` (direct when peer memory is eligible on every rank, else allgather; see ``reason``).
        memory: ``"auto" | "vmm" | "symm" | "host"`` for the direct backend's exposed buffer.
        timeout_s: bound on every wait for a peer (direct backend), in seconds (0 < timeout_s <= 1e6). The
            allgather backend (also ``auto``'s fallback) bounds its all-gather by it on CPU tensors (gloo); on the
            GPU it waits as NCCL does: a missing peer there ends in the process group's own timeout and error.
        pad_heads_to: None, 64 or 128: zero-pad the widened heads to this count (FlashMLA's sparse decode
            takes 64 or 128 heads); must be >= W * H.
        impl: kernel: direct ``"cuda"`` (csrc/query/direct.cu) or ``"triton"``; allgather ``"triton"``
            (fused) or ``"torch"`` (the plain reference ops); ``"auto"`` picks the fastest available (on a
            GPU the CUDA kernel; the Triton direct kernel where it cannot be built, and under the interpreter).
        exchange: direct backend, what the peers read: ``"raw"`` (the un-rotated bf16 shard; consumers
            rotate and convert), ``"roped"`` (rows the producer already rotated and converted), ``"push"``
            (the producer rotates and converts its rows and stores them into every consumer's slot: NVLink
            stores instead of loads; its two slots hold W sources' rows, W * out-size / 2 times a raw slot;
            the CUDA kernel sends calls within the byte bounds of ``TUNING`` with flag-in-data protocols: LL,
            SN - the sentinel push, no flag bytes, the default up to 256 tokens of 32 heads -, LL12, LL128),
            ``"auto"`` (with the CUDA kernel, those protocols within their bounds; above them
            push where its slots cost at most ``PUSH_AUTO_MAX_GROWTH`` raw slots - W = 2
            with FP8 - else raw for T <= ``AUTO_RAW_MAX_TOKENS`` and roped above; see :func:`copy_mode`).
            All give the same bytes provided every rank passes the same ``positions`` and
            ``cos_sin_cache`` (as in DCP, where every rank holds every token): raw and allgather rotate
            every row with the *caller's* positions, roped and push with the *producer's*; and SN with BF16
            output sends a 0xFFFF input half (a NaN) as the canonical NaN 0x7FC0.
        device: the tensors' device (default: the current CUDA device, else CPU).
        num_programs: direct backend grid size (default on GPU: 2 per SM, or for an object whose copy calls use
            the CUDA sentinel push up to ``TUNING["cuda_sn_programs_per_sm"]`` per SM, as many as are resident
            at once, of which an SN call launches only what it needs (:func:`launch_blocks`); 4 in the
            interpreter).

    Attributes:
        backend, memory (None for allgather), impl, exchange, reason (why auto chose what it chose),
        world_size, rank, heads_per_rank, out_heads (W*H or the padding), head_dim (nope + rope).

    Raises:
        ValueError / TypeError: bad arguments, or geometry that differs across ranks (on every rank).
        PeerSetupError: a collective setup step failed on some rank (raised on every rank).
    """

    def __init__(
        self,
        group=None,
        *,
        max_tokens: int,
        heads_per_rank: int,
        nope_dim: int = 512,
        rope_dim: int = 64,
        rope_style: str = "interleaved",
        out_dtype: torch.dtype = torch.float8_e4m3fn,
        quant_scale: float = 1.0,
        backend: str = "auto",
        memory: str = "auto",
        timeout_s: float = 10.0,
        pad_heads_to: int | None = None,
        impl: str = "auto",
        exchange: str = "auto",
        device: torch.device | str | int | None = None,
        num_programs: int | None = None,
    ) -> None:
        self._closed = True
        self._buf = None
        self._failure: PeerTimeoutError | None = None
        info = resolve_group(group)
        self._info = info
        self.world_size, self.rank = info.world_size, info.rank
        local_err: BaseException | None = None
        try:
            dev = resolve_device(device)
            self._validate_config(
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
                dev,
            )
        except (ValueError, TypeError) as e:
            local_err = e
        geometry = None
        if local_err is None:
            geometry = dict(
                max_tokens=max_tokens,
                heads_per_rank=heads_per_rank,
                nope_dim=nope_dim,
                rope_dim=rope_dim,
                rope_style=rope_style,
                out_dtype=str(out_dtype),
                quant_scale=float(quant_scale),
                backend=backend,
                memory=memory,
                pad_heads_to=pad_heads_to,
                impl=impl,
                exchange=exchange,
                device_type=dev.type,
                num_programs=num_programs,
            )
        peers = all_gather_object(
            info, (None if local_err is None else f"{type(local_err).__name__}: {local_err}", geometry)
        )
        if local_err is not None:
            raise local_err
        bad = [(r, m) for r, (m, _) in enumerate(peers) if m is not None]
        if bad:
            raise PeerSetupError("QueryGather: bad arguments on " + "; ".join(f"rank {r}: {m}" for r, m in bad))
        for key in geometry:
            vals = [g[key] for _, g in peers]
            if len(set(map(repr, vals))) != 1:
                raise ValueError(f"QueryGather: {key} must be the same on every rank, got {vals} (by rank)")

        self.device = dev
        self.max_tokens = max_tokens
        self.heads_per_rank = H = heads_per_rank
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        self.head_dim = nope_dim + rope_dim
        self.rope_style = rope_style
        self.out_dtype = out_dtype
        # the kernels multiply in fp32: keep the scale as the fp32 value they use
        self.quant_scale = float(torch.tensor(float(quant_scale), dtype=torch.float32))
        self.timeout_s = float(timeout_s)
        self.out_heads = pad_heads_to if pad_heads_to is not None else self.world_size * H
        self._gpu = on_gpu(dev)
        self._exposed_T: int | None = None
        self._push_slots = False  # direct: slots 0/1 sized for the push exchange (set below)
        # direct, CUDA, exchange auto / push: the most tokens a call sends by LL / LL12 / LL128 (copy_mode)
        self._ll_max = self._ll12_max = self._ll128_max = self._sn_max = 0
        self._ll_area = 0  # tokens the LL area (LL and LL12 calls) holds per (parity, source)
        self._ll128_lines = 0  # 128-byte lines per (parity, source) of the LL128 area
        self._early = False  # LL push calls load their first inputs early (TUNING["cuda_ll_early"])

        reasons: list[str] = []
        chosen = backend
        kind = None
        if backend in ("auto", "direct"):
            try:
                kind, why = _memory.choose_memory(info, memory, dev)
                chosen = "direct"
                reasons.append(f"direct over {kind} memory ({why})")
            except PeerSetupError as e:
                if backend == "direct":
                    raise
                chosen = "allgather"
                reasons.append(f"allgather: peer memory is not eligible ({e})")
        else:
            reasons.append("allgather requested")
        self.backend = chosen
        self.memory = kind if chosen == "direct" else None
        self.impl = self._choose_impl(impl, reasons)
        self._pdl_max = int(TUNING["cuda_pdl_max_tokens"]) if self.impl == "cuda" else 0
        self._sn_pdl = bool(TUNING["cuda_sn_pdl"])
        self._sn_upb = int(TUNING["cuda_sn_units_per_block"])  # SN grid per call: ceil(T * H / this) (0: whole)
        self._sn_floor = 0  # ... but at least this many blocks (on CUDA: TUNING per SM times the SMs)
        self._sn_wide_min: int | None = None  # SN calls with T above it use 16-byte stores (None: never)
        if self._pdl_max:
            reasons.append(f"PDL launch for T <= {self._pdl_max}")
        self.exchange = exchange if chosen == "direct" else None
        if chosen == "direct":
            self.exchange = exchange
            growth = self.world_size * out_dtype.itemsize / 2  # push slot / raw slot
            self._push_slots = exchange == "push" or (exchange == "auto" and growth <= PUSH_AUTO_MAX_GROWTH)
            if exchange in ("auto", "push") and self.impl == "cuda":  # the LL areas need no push slots
                row_bytes = H * self.head_dim * out_dtype.itemsize  # one token's finished rows
                bound = {k: min(max_tokens, tuning_bytes(f"cuda_{k}_max_bytes", out_dtype) // row_bytes) for k in
                         ("ll", "sn", "ll12", "ll128")}  # fmt: skip
                if self.head_dim * out_dtype.itemsize % 24:  # LL12 moves whole 24-byte triples of a row
                    bound["ll12"] = 0
                self._ll_max = bound["ll"]
                self._sn_max = bound["sn"] if bound["sn"] > self._ll_max else 0
                if self._sn_max and rope_style == "interleaved" and out_dtype == torch.float8_e4m3fn:
                    self._sn_wide_min = tuning_bytes("cuda_sn_wide_min_bytes", out_dtype) // row_bytes
                below = max(self._ll_max, self._sn_max)
                self._ll12_max = bound["ll12"] if bound["ll12"] > below else 0
                self._ll128_max = bound["ll128"] if bound["ll128"] > max(below, self._ll12_max) else 0
                self._ll_area = max(self._ll_max, self._ll12_max)
                self._ll128_lines = -(-(self._ll128_max * row_bytes // 8) // 15)  # 15 data words per line
            self._early = bool(TUNING["cuda_ll_early"])
            if self._push_slots:
                rule = f"raw for T <= {AUTO_PUSH_RAW_MAX_TOKENS}, else push" if AUTO_PUSH_RAW_MAX_TOKENS else "push"
            else:
                rule = f"raw for T <= {AUTO_RAW_MAX_TOKENS}, else roped"
            lls = [("LL", self._ll_max), ("SN", self._sn_max), ("LL12", self._ll12_max), ("LL128", self._ll128_max)]
            lls = [(n, b) for n, b in lls if b]
            ll_rule = ", ".join(f"{n} push for T <= {b}" for n, b in lls)
            if ll_rule:
                rule = ll_rule + ", then " + rule
            reasons.append(f"exchange {exchange}" + (f" ({rule})" if exchange == "auto" else ""))
            if self._sn_wide_min is not None and self._sn_wide_min < self._sn_max:
                reasons.append(f"SN calls with T > {self._sn_wide_min} store 16 bytes per thread")
            if ll_rule and exchange == "push":
                reasons.append(ll_rule.replace(" push", " protocol"))
            self._setup_direct(num_programs, reasons)
        else:
            self._setup_allgather()
        self.reason = "; ".join(reasons)
        self._closed = False

    # ------------------------------------------------------------------------------------ setup
    def _validate_config(
        self,
        max_tokens,
        H,
        nope,
        rope,
        style,
        out_dtype,
        scale,
        backend,
        memory,
        timeout_s,
        pad,
        impl,
        exchange,
        nprog,
        dev,
    ) -> None:
        W = self.world_size
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

    def _choose_impl(self, impl: str, reasons: list[str]) -> str:
        info = self._info
        if self.backend == "allgather":
            chosen = "triton" if impl == "auto" else impl
            what = " (one fused Triton RoPE + convert kernel)" if chosen == "triton" else " (plain torch ops)"
            reasons.append(f"impl {chosen}{what}")
            return chosen
        want = impl
        if impl == "auto":
            want = DEFAULT_GPU_IMPL if self._gpu else "triton"
        if want == "cuda" and (self.nope_dim % 16 or self.world_size > 8):
            why = f"nope_dim {self.nope_dim} is not a multiple of 16 or W = {self.world_size} > 8"
            if impl == "cuda":
                raise ValueError(f"impl='cuda' needs nope_dim % 16 == 0 and W <= 8: {why}")
            reasons.append(f"impl triton (the CUDA kernel does not cover this geometry: {why})")
            return "triton"
        err = None
        if want == "cuda":
            try:
                from . import ops

                ops.load()
            except Exception as e:  # noqa: BLE001 - reported to every rank
                err = f"{type(e).__name__}: {e}"
        errs = all_gather_object(info, err)
        failed = [(r, m) for r, m in enumerate(errs) if m is not None]
        if failed and impl == "cuda":
            agree(info, err, "QueryGather CUDA kernel build")
        if failed:
            reasons.append(f"impl triton (the CUDA kernel is unavailable on rank {failed[0][0]}: {failed[0][1]})")
            return "triton"
        reasons.append(f"impl {want}" + (" (default)" if impl == "auto" else ""))
        return want

    def _setup_direct(self, num_programs: int | None, reasons: list[str]) -> None:
        info, dev, W, H = self._info, self.device, self.world_size, self.heads_per_rank
        if dev.type == "cuda":  # the SN call grid's floor, whoever sized the object's grid
            sms = num_sms(dev.index)
            self._sn_floor = int(TUNING["cuda_sn_min_blocks_per_sm"] * sms)
        if num_programs is None:
            if dev.type == "cuda":
                per_sm = 2
                if self._sn_max:  # the sentinel push: more blocks in flight, as many as fit at once
                    from . import ops

                    per_sm = max(
                        2,
                        min(
                            int(TUNING["cuda_sn_programs_per_sm"]),
                            ops.sn_blocks_per_sm(self.rope_style == "neox", self.out_dtype == torch.float8_e4m3fn),
                        ),
                    )
                num_programs = per_sm * sms
            else:
                num_programs = 4
        grids = all_gather_object(info, (num_programs, self._sn_floor))
        self.num_programs = NP = min(g[0] for g in grids)  # the grids must match: twin programs wait for each other
        self._sn_floor = min(g[1] for g in grids)  # (SN areas are unit-indexed; one rule everywhere all the same)
        if self._sn_max and dev.type == "cuda":
            pdl = ", PDL on every SN call" if self._sn_pdl else ""
            cut = ""
            if self._sn_upb > 0:
                cut = f"; an SN call on ceil(T*H/{self._sn_upb}) of them, at least min(T*H, {self._sn_floor})"
            reasons.append(
                f"grid {NP} blocks (sentinel push: up to {TUNING['cuda_sn_programs_per_sm']} per SM{pdl}{cut})"
            )
        self._bu = 4 if self._gpu else 2
        raw_bytes = self.max_tokens * H * self.head_dim * 2
        slot_bytes = raw_bytes
        if self._push_slots:
            osize = self.out_dtype.itemsize
            slot_bytes = max(raw_bytes, W * K.push_region_bytes(self.max_tokens, H, self.head_dim, osize))
        self._slot_bytes = -(-slot_bytes // 256) * 256
        self._data_off = K.header_bytes(NP, W)
        # slots 0 and 1 (parity; any exchange), slot Z (exposed: a raw slot), then the LL area of the CUDA
        # LL / LL12 push calls, sized for the LL layout (LL12 lines need 2/3 of it) of _ll_area tokens:
        # [2 parity][W src][_ll_area][H][2 * D * out-size] bytes, then the LL128 area of the calls with
        # T <= _ll128_max: [2 parity][W src][_ll128_lines][128] bytes
        self._ll_off = -(-(self._data_off + 2 * self._slot_bytes + raw_bytes) // 256) * 256
        ll_bytes = 2 * W * self._ll_area * H * 2 * self.head_dim * self.out_dtype.itemsize
        self._ll128_off = -(-(self._ll_off + ll_bytes) // 256) * 256
        # then the sentinel area of the SN push calls: [2 parity][W src][_sn_max][H][D] out-dtype rows
        self._sn_off = -(-(self._ll128_off + 2 * W * self._ll128_lines * 128) // 256) * 256
        sn_bytes = 2 * W * self._sn_max * H * self.head_dim * self.out_dtype.itemsize
        self._buf = _memory.allocate(self._sn_off + sn_bytes, info.group, memory=self.memory, device=dev)
        if sn_bytes:  # its rest state (every byte 0xFF), before any peer can publish into it
            self._buf.fill_collective(self._sn_off, sn_bytes, 0xFF)
        local_err = None
        try:
            self._epochs = torch.zeros(NP, dtype=torch.int64, device=dev)
            self._last_z = torch.zeros(NP, dtype=torch.int64, device=dev)
            self._err = ErrorWord(dev, self.timeout_s)
            self._timeout_ns = int(self.timeout_s * 1e9)
            self._spins = spin_budget(self.timeout_s, dev)
            self._mech = mechanism_code("query")
            z = self._data_off + K.SLOT_Z * self._slot_bytes
            n_nope = self.max_tokens * H * self.nope_dim
            self._z_nope = self._buf.view(self.rank, (self.max_tokens, H, self.nope_dim), torch.bfloat16, z)
            self._z_pe = self._buf.view(self.rank, (self.max_tokens, H, self.rope_dim), torch.bfloat16, z + 2 * n_nope)
        except Exception as e:  # noqa: BLE001 - (out of device / pinned memory on this rank: agreed below)
            local_err = e
        agree_or_release(info, local_err, "QueryGather set-up after the allocation", self._buf)

    def _setup_allgather(self) -> None:
        H, D, dev = self.heads_per_rank, self.head_dim, self.device
        self.num_programs = None
        self._staging = torch.empty((self.max_tokens, H, D), dtype=torch.bfloat16, device=dev)
        self._gathered = torch.empty(self.world_size * self.max_tokens * H * D, dtype=torch.bfloat16, device=dev)
        self._err = None

    # ------------------------------------------------------------------------------ lifetime
    def _release(self) -> None:
        self._z_nope = self._z_pe = None
        self._staging = self._gathered = None

    def __repr__(self) -> str:
        return (
            f"QueryGather(backend={self.backend!r}, memory={self.memory!r}, impl={self.impl!r}, "
            f"exchange={self.exchange!r}, W={self.world_size}, H={self.heads_per_rank}, "
            f"D={self.nope_dim}+{self.rope_dim}, out={self.out_dtype}, {'closed' if self._closed else 'open'})"
        )

    # ---------------------------------------------------------------------------- validation
    def _check_shard(self, name: str, x, width: int) -> int:
        H = self.heads_per_rank
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be torch.bfloat16, got {x.dtype}")
        if x.dim() != 3 or x.shape[1] != H or x.shape[2] != width:
            raise ValueError(f"{name} must have shape [T, {H}, {width}], got {list(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{name} must be on {self.device}, got {x.device}")
        T = x.shape[0]
        if self.max_tokens < T:
            raise ValueError(f"{name} has T = {T} tokens, more than max_tokens = {self.max_tokens}")
        if x.numel() and (x.stride(2) != 1 or x.stride(0) % 8 or x.stride(1) % 8 or x.data_ptr() % 16):
            raise ValueError(
                f"{name} must have a contiguous last dim, strides that are multiples of 8 elements and a "
                f"16-byte aligned data pointer (16-byte rows); got strides {x.stride()}"
            )
        return T

    def _check_common(self, T: int, positions, cos_sin_cache, out) -> None:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be torch.int32 or torch.int64, got {positions.dtype}")
        if positions.dim() != 1 or positions.shape[0] != T:
            raise ValueError(f"positions must have shape [T] = [{T}], got {list(positions.shape)}")
        if positions.device != self.device:
            raise ValueError(f"positions must be on {self.device}, got {positions.device}")
        if T > 1 and positions.stride(0) != 1:
            raise ValueError(f"positions must be contiguous, got stride {positions.stride()}")
        if not isinstance(cos_sin_cache, torch.Tensor):
            raise TypeError(f"cos_sin_cache must be a torch.Tensor, got {type(cos_sin_cache).__name__}")
        if cos_sin_cache.dtype != torch.float32:
            raise TypeError(f"cos_sin_cache must be torch.float32, got {cos_sin_cache.dtype}")
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != self.rope_dim or cos_sin_cache.shape[0] < 1:
            raise ValueError(
                f"cos_sin_cache must have shape [max_pos, {self.rope_dim}] (rows [cos | sin]), "
                f"got {list(cos_sin_cache.shape)}"
            )
        if cos_sin_cache.device != self.device:
            raise ValueError(f"cos_sin_cache must be on {self.device}, got {cos_sin_cache.device}")
        if not cos_sin_cache.is_contiguous() or cos_sin_cache.data_ptr() % 16:
            raise ValueError("cos_sin_cache must be contiguous with a 16-byte aligned data pointer")
        if positions.device.type == "cpu" and T:
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= cos_sin_cache.shape[0]:
                raise ValueError(
                    f"positions must be in [0, {cos_sin_cache.shape[0]}) (rows of cos_sin_cache), got [{lo}, {hi}]"
                )
        if out is not None:
            shape = [T, self.out_heads, self.head_dim]
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if out.dtype != self.out_dtype:
                raise TypeError(f"out must be {self.out_dtype}, got {out.dtype}")
            if list(out.shape) != shape or not out.is_contiguous() or out.device != self.device or out.data_ptr() % 16:
                raise ValueError(
                    f"out must be a contiguous, 16-byte aligned {shape} tensor on {self.device}, got "
                    f"{list(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})"
                )

    def _new_out(self, T: int, out):
        if out is None:
            out = torch.empty((T, self.out_heads, self.head_dim), dtype=self.out_dtype, device=self.device)
        return out

    def _bits(self, out: torch.Tensor) -> torch.Tensor:
        return out.view(torch.uint8) if self.out_dtype == torch.float8_e4m3fn else out.view(torch.int16)

    # ------------------------------------------------------------------------------------ calls
    def gather(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The widened query of the group (collective: every rank calls it with the same T).

        Args:
            q_nope: ``[T, H, nope]`` bf16, this rank's heads (last dim contiguous, strides multiples of 8).
            q_pe: ``[T, H, rope]`` bf16, un-rotated.
            positions: ``[T]`` int32/int64, rows of ``cos_sin_cache`` (checked on CPU; on GPU not checked
                - that would synchronize - and clamped into the table).
            cos_sin_cache: ``[max_pos, rope]`` fp32, rows ``[cos | sin]`` (see :mod:`peerdcp.query.rope`).
            out: optional ``[T, out_heads, nope + rope]`` output (``out_dtype``, contiguous).

        Returns:
            ``q [T, out_heads, nope + rope]`` in ``out_dtype``: widened head ``s*H + h`` is head h of rank s,
            ``[nope | rotated rope]``, padding heads zero.

        Raises:
            ValueError / TypeError: bad input, before any launch or peer store.
            PeerTimeoutError: a wait of this or an earlier call timed out (see the module docstring).
        """
        self._ready("gather")
        T = self._check_shard("q_nope", q_nope, self.nope_dim)
        T2 = self._check_shard("q_pe", q_pe, self.rope_dim)
        if T2 != T:
            raise ValueError(f"q_pe has {T2} tokens, q_nope has {T}")
        self._check_common(T, positions, cos_sin_cache, out)
        out = self._new_out(T, out)
        if T == 0:
            return out
        if self.backend == "direct":
            mode = self._copy_mode(T)
            self._launch_direct(mode, q_nope, q_pe, positions, cos_sin_cache, out, T)
        else:
            self._allgather(q_nope, q_pe, positions, cos_sin_cache, out, T)
        return out

    def exposed_shard(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy producer API (direct backend): views of this rank's exposed bf16 shard.

        Enqueues (on the current stream) a bounded wait until every peer finished reading the previous
        exposed shard, then returns ``(q_nope [T, H, nope], q_pe [T, H, rope])`` bf16 views; write the
        projection into them on the same stream, then call :meth:`gather_exposed` with the same T.
        The views alias the same memory every call (CUDA-graph friendly), and only until :meth:`close`: the
        memory under them is unmapped then, and a store through a kept view faults the process.
        """
        self._ready("exposed_shard")
        if self.backend != "direct":
            raise ValueError(f"exposed_shard needs backend='direct', this object uses {self.backend!r}")
        if not is_int(num_tokens):
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"num_tokens must be in [1, {self.max_tokens}], got {num_tokens}")
        self._launch_wait_acks()
        self._exposed_T = num_tokens
        return self._z_nope[:num_tokens], self._z_pe[:num_tokens]

    def gather_exposed(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`gather` of the shard written into the :meth:`exposed_shard` views (T = ``positions.shape[0]``)."""
        self._ready("gather_exposed")
        if self.backend != "direct":
            raise ValueError(f"gather_exposed needs backend='direct', this object uses {self.backend!r}")
        if self._exposed_T is None:
            raise ValueError("gather_exposed: call exposed_shard(T) first (and write the shard into its views)")
        T = self._exposed_T
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dim() != 1 or positions.shape[0] != T:
            raise ValueError(
                f"positions must have shape [T] = [{T}] (the T of exposed_shard), got {list(positions.shape)}"
            )
        self._check_common(T, positions, cos_sin_cache, out)
        out = self._new_out(T, out)
        self._exposed_T = None
        self._launch_direct(K.MODE_EXPOSED, self._z_nope, self._z_pe, positions, cos_sin_cache, out, T)
        return out

    def _copy_mode(self, T: int) -> int:
        """The kernel mode of a copy call with T tokens (see :func:`copy_mode`)."""
        return copy_mode(
            self.exchange,
            T,
            push_slots=self._push_slots,
            ll_max=self._ll_max,
            ll12_max=self._ll12_max,
            ll128_max=self._ll128_max,
            sn_max=self._sn_max,
        )

    # ---------------------------------------------------------------------------------- launches
    def _launch_blocks(self, mode: int, T: int) -> int:
        """The CUDA grid of a call of ``mode`` with T tokens (:func:`launch_blocks`)."""
        return launch_blocks(mode, T, self.heads_per_rank, self.num_programs, self._sn_upb, self._sn_floor)

    def _launch_direct(self, mode, q_nope, q_pe, positions, cos_sin_cache, out, T) -> None:
        buf = self._buf
        if self.impl == "cuda":
            from . import ops

            # PDL for T <= cuda_pdl_max_tokens, and for every SN call with cuda_sn_pdl (local to a rank)
            bits = K.MODE_PDL if self._pdl_max >= T or (mode == K.MODE_PUSH_SN and self._sn_pdl) else 0
            if mode == K.MODE_PUSH_SN and self._sn_wide_min is not None and self._sn_wide_min < T:
                bits |= K.MODE_WIDE  # 16-byte stores (no early load: the SN16 kernel loads pairs)
            elif mode in (K.MODE_PUSH_LL, K.MODE_PUSH_SN) and self._early:
                bits |= K.MODE_EARLY

            ops.query_direct(
                q_nope,
                q_pe,
                positions,
                cos_sin_cache,
                out,
                buf.peer_addrs,
                self._epochs,
                self._last_z,
                self._err.kernel_arg(),
                self._timeout_ns,
                self.quant_scale,
                T,
                self.rank,
                self.world_size,
                self.heads_per_rank,
                self.out_heads,
                self.nope_dim,
                self.rope_dim,
                self.max_tokens,
                self._data_off,
                self._slot_bytes,
                self._ll_off,
                self._ll_area,
                self._ll128_off,
                self._ll128_lines,
                self._sn_off,
                self._sn_max,
                self.num_programs,
                mode | bits,
                self.rope_style == "neox",
                self._mech,
                self._launch_blocks(mode, T),
            )
        else:
            K.direct_kernel[(self.num_programs,)](
                q_nope,
                q_pe,
                q_nope.stride(0),
                q_nope.stride(1),
                q_pe.stride(0),
                q_pe.stride(1),
                positions,
                cos_sin_cache,
                cos_sin_cache.shape[0],
                self._bits(out),
                buf.peer_ptrs,
                self._epochs,
                self._last_z,
                self._err.kernel_arg(),
                self._timeout_ns,
                self._spins,
                self.quant_scale,
                T,
                self.rank,
                self.max_tokens,
                self._data_off,
                self._slot_bytes,
                W=self.world_size,
                H=self.heads_per_rank,
                HOUT=self.out_heads,
                NOPE=self.nope_dim,
                ROPE=self.rope_dim,
                NPROG=self.num_programs,
                BU=self._bu,
                MODE=mode,
                NEOX=self.rope_style == "neox",
                OUT_FP8=self.out_dtype == torch.float8_e4m3fn,
                MECH=self._mech,
                GPU=self._gpu,
                num_warps=4,
                enable_fp_fusion=False,
            )
        self._after_launch()

    def _launch_wait_acks(self) -> None:
        if self.impl == "cuda":
            from . import ops

            ops.query_wait_acks(
                self._buf.peer_addrs,
                self._last_z,
                self._err.kernel_arg(),
                self._timeout_ns,
                self.rank,
                self.world_size,
                self.num_programs,
                self._mech,
            )
        else:
            K.wait_acks_kernel[(self.num_programs,)](
                self._buf.peer_ptrs,
                self._last_z,
                self._err.kernel_arg(),
                self._timeout_ns,
                self._spins,
                self.rank,
                W=self.world_size,
                NPROG=self.num_programs,
                MECH=self._mech,
                GPU=self._gpu,
                num_warps=1,
            )
        self._after_launch()

    def _after_launch(self) -> None:
        # The interpreter runs the kernel synchronously: report a timeout at once. On the GPU the host
        # never waits; the next call (or check()) reads the pinned error word.
        if not self._gpu:
            self._ready("gather")

    def _allgather(self, q_nope, q_pe, positions, cos_sin_cache, out, T) -> None:
        W, H, D = self.world_size, self.heads_per_rank, self.head_dim
        staging = self._staging[:T]
        torch.cat((q_nope, q_pe), dim=-1, out=staging)
        gathered = self._gathered[: W * T * H * D]
        try:
            _all_gather_into(gathered, staging, self._info, self.timeout_s)
        except PeerTimeoutError as e:
            self._failure = e
            raise
        g = gathered.view(W, T, H, D)
        if self.impl == "torch":
            q = widened_query(
                [g[s, :, :, : self.nope_dim] for s in range(W)],
                [g[s, :, :, self.nope_dim :] for s in range(W)],
                positions,
                cos_sin_cache,
                rope_style=self.rope_style,
                out_dtype=self.out_dtype,
                quant_scale=self.quant_scale,
                pad_heads_to=self.out_heads if self.out_heads > W * H else None,
            )
            out.copy_(q)
            return
        n_main = triton.cdiv(T * W * H, 4)
        n_pad = triton.cdiv(T * (self.out_heads - W * H), 4)
        K.allgather_rope_kernel[(n_main + n_pad,)](
            g,
            positions,
            cos_sin_cache,
            cos_sin_cache.shape[0],
            self._bits(out),
            self.quant_scale,
            T,
            W=W,
            H=H,
            HOUT=self.out_heads,
            NOPE=self.nope_dim,
            ROPE=self.rope_dim,
            BU=4,
            NEOX=self.rope_style == "neox",
            OUT_FP8=self.out_dtype == torch.float8_e4m3fn,
            GPU=self._gpu,
            num_warps=4,
            enable_fp_fusion=False,
        )


def _all_gather_into(dst: torch.Tensor, src: torch.Tensor, info, timeout_s: float) -> None:
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
