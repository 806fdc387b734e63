"""`OutputReducer`: the DCP Output/LSE exchange (DESIGN.md sections 3, 5, 6).

Each rank holds a partial attention output for the widened head set and needs, for its own heads, the
LSE-weighted combine of every rank's partial. Backends:

* ``"direct"`` - producer-direct over peer memory (``memory`` vmm | symm | host): each rank stores every
  destination's head slice ``[T, H, D]`` and LSE ``[T, H]`` straight into that destination's inbox,
  release-signals, acquire-waits (bounded) for every source, and combines - one fused kernel
  (``csrc/output/direct.cu`` on CUDA, or the Triton twin ``kernels.direct_kernel``; the Triton kernel is
  also the CPU path under ``TRITON_INTERPRET=1``). Device-side epochs with two parity slots: no host
  sync and no barrier between calls; capturable in CUDA graphs. For small T the CUDA kernel uses the
  LL protocol (the flag rides in every 8-byte word: no fence, no flag round trip), above it the sentinel
  protocol (the inbox holds a reserved 16-bit pattern at rest, so every payload vector signals its own
  arrival; for large T a few CTAs publish while the others combine).
* ``"a2a"`` - pack + ``all_to_all_single`` + Triton combine (torch.distributed: NCCL / gloo).
* ``"ag_rs"`` - all-gather of the LSE, local correction, ``reduce_scatter`` (fp32).
* ``"auto"`` - ``direct`` when peer memory is eligible (vmm, then symm; host for CPU), else ``a2a``;
  ``.reason`` says why.

Lifecycle::

    red = OutputReducer(group, max_tokens=256, heads_per_rank=16, head_dim=512)   # collective
    out = red.reduce(partial_out, partial_lse)        # every rank, same T, same order of calls
    red.check()                                       # raises PeerTimeoutError if a wait expired
    red.close()                                       # collective, idempotent

.. important:: Every rank must call :meth:`reduce` the same number of times with the same ``T`` (as a DCP
   decode step does). A rank that does not arrive within ``timeout_s`` makes its peers' kernel give up
   and the reducer raises :class:`~peerdcp.PeerTimeoutError` (waiting rank, missing peer, mechanism
   ``"output"``) at the next call or :meth:`check`; it then refuses every call until re-created. Ranks
   that call with different ``T`` are a usage error; it surfaces as a timeout on at least one rank (the
   flag carries T; under the LL protocol the rank expecting more tokens times out).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton

from .._runtime.checks import resolve_device, timeout_problem
from .._runtime.device import ErrorWord, mechanism_code, num_sms, on_gpu, spin_budget
from .._runtime.groups import agree, agree_or_release, all_gather_object, bounded_collective, resolve_group
from .._runtime.lifecycle import Collective
from ..errors import PeerSetupError, PeerTimeoutError
from ..memory import allocate, choose_memory
from . import kernels as K
from .reference import normalize_lse_base

__all__ = ["OutputReducer", "BACKENDS", "KERNELS", "DIRECT_KERNEL_DEFAULT", "TUNING", "default_ll_max_tokens"]

BACKENDS = ("auto", "direct", "a2a", "ag_rs")
KERNELS = ("auto", "cuda", "triton")
DTYPES = (torch.bfloat16, torch.float16)

# Module-level switch: the direct kernel that kernel="auto" uses on CUDA ("cuda" or "triton"). The
# benchmark (bench/output.py) measures both; keep the faster one here. PEERDCP_OUTPUT_KERNEL overrides.
DIRECT_KERNEL_DEFAULT = os.environ.get("PEERDCP_OUTPUT_KERNEL", "cuda")

# Grid / tile tuning (identical on every rank; the grid never depends on T).
TUNING = {
    "cuda_programs_per_sm": 2,  # G = min(this, co-resident CTAs per SM) * SMs for the CUDA kernel
    "triton_programs_per_sm": 1,  # G = this * SMs for the Triton kernel on GPU
    "triton_unit_elems_gpu": 1024,  # elements per (token, head chunk) work unit, Triton on GPU
    "triton_unit_elems_cpu": 32,  # ... under the interpreter (tiny test shapes)
    "interpreter_programs": 3,  # G under TRITON_INTERPRET=1 (programs run one after another)
    "cuda_ll_max_tokens": 8,  # CUDA kernel: calls with T <= this use the LL protocol (flag inside the data) ...
    # ... while their slice per destination (T * heads * D * element bytes) is at most this; LL sends twice the
    # bytes. At W = 2 (PDL, graph), 16 heads x 512 bf16, LL is faster to T = 4 (3.70 vs 3.99 us) and slower at 8
    # (4.51 vs 4.30); at 32 heads faster to T = 2, slower at 4 (4.45 / 4.27) and 8 (5.96 / 4.66): LL wins up to
    # 64 KiB per destination (bench/RESULTS.md, Output/LSE).
    "cuda_ll_max_bytes": 65536,
    # CUDA kernel: calls with cuda_ll_max_tokens < T <= this use the LL128 protocol (flags inside 128-byte lines;
    # see csrc/output/direct.cu for the assumption it makes), larger T the next kernel; 0: off (the default).
    # Off because the sentinel kernel is faster in LL128's band (Kimi, PDL, graph: 5.5 vs 6.5 us at T = 24), where
    # LL128 beats the plain kernel (24 <= T <= 48: this = 48 with the minimum below is its best band).
    "cuda_ll128_max_tokens": 0,
    "cuda_ll128_min_tokens": 20,  # LL128 band only: calls with T <= this use LL / the plain kernel
    # CUDA kernel variants, read at construction and agreed by every rank (names of ops.OPTS):
    # "tight_grid" (launch only the CTAs that own a unit), "early_load" (input loads overlap the epoch read),
    # "pdl" (programmatic dependent launch; on by default: 0.3-0.5 us faster at every T, A/B in one benchmark
    # process), "ll128" (T > cuda_ll_max_tokens: flags inside 128-byte lines,
    # NCCL's LL128; relies on 128-byte line stores being seen whole, see csrc/output/direct.cu), "chunked"
    # (T > cuda_ll_max_tokens: the plain protocol released per chunk of units by a signalling warp, so the
    # combine overlaps the transfer), "split_roles" (with "chunked": separate publishing and combining
    # warps), "sentinel" (T > cuda_sentinel_min_tokens: the payload region holds a reserved 16-bit pattern at
    # rest, so every vector signals its own arrival - no fence, no flag bytes - and the combine runs under
    # the transfer; on by default: 1.0-1.6 us faster than the plain kernel for 12 <= T <= 64 and,
    # with split roles, 1.8-3.5 us for T >= 96, bench/RESULTS.md). () is the kernel without any (the plain
    # kernel above the LL range); bench/output.py measures the variants against the default.
    "cuda_opts": ("pdl", "sentinel"),
    # With "sentinel": calls with T > this use the sentinel kernel (LL and an LL128 band take precedence).
    "cuda_sentinel_min_tokens": 0,
    # With "sentinel": ((b, n, u), ...), b increasing: a call whose slice per destination (T * H * D * element
    # bytes) exceeds b (the last such entry) splits the CTAs - the first n publish, with u (1 or 2) 16-byte loads
    # in flight per thread, the others combine, so the combine runs under the transfer; a call at or below the
    # first b lets every CTA publish its share (2 loads in flight), then combine its share. Measured (2 x H200;
    # Kimi, 16 KiB per token): every CTA both to T = 16 (256 KiB; at T = 24-64 40 x 1 is
    # 5-10 % faster: T = 64 6.93 vs 7.62 us); 40 publishers with 1 load in flight to T = 160 (2.5 MiB; T = 128:
    # 9.84-9.92 vs 10.33 us with 36 x 2), 36 with 2 to T = 224 (T = 192: 13.44 us; 40 x 2: 14.61), 40 with 2 to
    # 6 MiB (T = 256: 16.9-17.1 us; 36 x 2: 17.5), 44 with 2 above (8 MiB: 29.4 vs 31.2 us with 40 x 2). The
    # optimum is sharp in n. In bytes, not tokens: DeepSeek's 32 heads/rank measured the same time as Kimi at the
    # same bytes (4 MiB: 17.03 / 17.03 us; 8 MiB: 29.37 / 29.44 with 44 x 2). () = never split.
    "cuda_sentinel_split": ((1 << 18, 40, 1), (5 << 19, 36, 2), (7 << 19, 40, 2), (3 << 21, 44, 2)),
}

# = peerdcp.output.ops.OPTS (not imported from there: ops loads the CUDA build)
_CUDA_OPTS = ("tight_grid", "early_load", "pdl", "ll128", "chunked", "split_roles", "sentinel")

_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ll128_band(
    ll128_max_tokens, cuda_opts: tuple, max_tokens, ll_max_tokens, heads_per_rank, head_dim
) -> tuple[int, int]:
    """(max, min) of the CUDA kernel's LL128 band: calls with ``max(ll_max_tokens, min) < T <= max`` use LL128.
    (0, 0) when no call would: LL128 off, a band at or below the LL range, ``tight_grid`` (LL128 runs every
    CTA in every call) or ``chunked`` (which replaces it); the ``"ll128"`` option makes it every T above the LL
    range. Arguments as given to OutputReducer (possibly invalid: then (0, 0); they are reported elsewhere)."""
    hi = TUNING["cuda_ll128_max_tokens"] if ll128_max_tokens is None else ll128_max_tokens
    lo = TUNING["cuda_ll128_min_tokens"]
    if "ll128" in cuda_opts:
        hi, lo = max_tokens, 0
    elif "tight_grid" in cuda_opts or "chunked" in cuda_opts:
        hi = 0
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (hi, lo, max_tokens, ll_max_tokens)):
        return 0, 0
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (heads_per_rank, head_dim)):
        return 0, 0
    hi = min(hi, max_tokens)
    if hi <= max(ll_max_tokens, lo):  # the band is empty
        return 0, 0
    return hi, lo


def sentinel_split_tokens(table, bytes_per_token: int, programs: int) -> tuple:
    """``TUNING["cuda_sentinel_split"]`` (slice-byte thresholds) as the launcher's token thresholds:
    ``T > b // bytes_per_token`` exactly when ``T * bytes_per_token > b``; a publisher count of at least the
    grid (``programs``) means every CTA publishes and combines (0)."""
    return tuple((b // bytes_per_token, n if n < programs else 0, u) for b, n, u in table)


def _split_table_ok(table) -> bool:
    """``TUNING["cuda_sentinel_split"]``: a tuple of (byte threshold, publisher CTAs, loads in flight) int
    triples, thresholds increasing, loads 1 or 2."""
    if not isinstance(table, (tuple, list)):
        return False
    last = -1
    for entry in table:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            return False
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in entry) or entry[0] <= last:
            return False
        if entry[2] not in (1, 2):
            return False
        last = entry[0]
    return True


def default_ll_max_tokens(heads_per_rank: int, head_dim: int, dtype: torch.dtype) -> int:
    """The CUDA kernel's default LL range (calls with ``T <=`` it use LL): ``TUNING["cuda_ll_max_tokens"]``, cut
    so that a call's slice per destination, ``T * heads_per_rank * head_dim * element bytes``, stays within
    ``TUNING["cuda_ll_max_bytes"]`` (16 heads x 512 bf16: 4 tokens; 32 heads: 2; 8 heads: 8). Arguments that
    are not positive ints give the token bound alone (the constructor reports them)."""
    cap = int(TUNING["cuda_ll_max_tokens"])
    size = getattr(dtype, "itemsize", 2)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (heads_per_rank, head_dim)):
        return cap
    return min(cap, int(TUNING["cuda_ll_max_bytes"]) // (heads_per_rank * head_dim * size))


class OutputReducer(Collective):
    """LSE-weighted reduce of DCP partial attention outputs to each rank's own heads.

    Args:
        group: the DCP ``ProcessGroup`` (None: default group). Collective setup goes over a gloo twin.
        max_tokens: the largest T :meth:`reduce` will see (inbox capacity), ``1 <= max_tokens < 2**20``.
        heads_per_rank: H, heads each rank owns after the reduce (the widened set has W*H).
        head_dim: D (512 for MLA's kv_lora_rank).
        dtype: ``torch.bfloat16`` or ``torch.float16`` (partial and merged outputs).
        backend: ``"auto"`` | ``"direct"`` | ``"a2a"`` | ``"ag_rs"``.
        memory: peer memory for ``direct``: ``"auto"`` | ``"vmm"`` | ``"symm"`` | ``"host"``.
        lse_base: ``"e"`` (natural log: FlashMLA) or ``2`` (log2: FlashInfer, trtllm).
        timeout_s: bound of every wait of the direct backend for a peer, in seconds (0 < timeout_s <= 1e6). The
            collective backends (``a2a``, ``ag_rs``, and ``auto``'s fallback to them) bound each collective by it
            on CPU tensors (gloo; not ``ag_rs``'s reduce-scatter, whose gloo work ignores a bound: its all-gather
            comes first); on the GPU they wait as NCCL does: a missing peer there ends in the process group's own
            timeout and error.
        device: CUDA device (default: current) or ``"cpu"`` (host memory, interpreter kernels).
        kernel: direct kernel: ``"auto"`` (:data:`DIRECT_KERNEL_DEFAULT` on CUDA, Triton on CPU),
            ``"cuda"`` (``csrc/output/direct.cu``; needs ``D % 8 == 0``, W <= 8) or ``"triton"``.
        programs: grid size G of the direct kernel (default: from :data:`TUNING` and the occupancy).
        ll_max_tokens: CUDA kernel only: calls with ``T <= ll_max_tokens`` use the LL protocol (each 8-byte
            word carries 4 data bytes and the call's flag: no fence, no flag round trip, twice the bytes).
            Default :func:`default_ll_max_tokens`; 0 turns it off.
        ll128_max_tokens: CUDA kernel only: calls with ``lo < T <= ll128_max_tokens`` use the LL128 protocol
            (flags inside 128-byte lines, as NCCL's LL128), ``lo = max(ll_max_tokens,
            TUNING["cuda_ll128_min_tokens"])``; other T the LL or plain protocol. Default
            ``TUNING["cuda_ll128_max_tokens"]`` (0: off; the sentinel kernel beat LL128 in its band, see TUNING);
            the ``"ll128"`` entry of ``TUNING["cuda_opts"]`` makes it every T above ``ll_max_tokens``; off with
            ``"tight_grid"`` or ``"chunked"``.

    Attributes: ``backend``, ``memory`` (None for collectives), ``kernel`` (direct only), ``reason``,
    ``rank``, ``world_size``, ``programs``.

    Raises:
        TypeError / ValueError: bad or mismatched arguments (on every rank, before anything is allocated).
        PeerSetupError: an explicitly requested peer memory is not usable (on every rank).
    """

    def __init__(
        self,
        group=None,
        *,
        max_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        memory: str = "auto",
        lse_base: str | int = "e",
        timeout_s: float = 10.0,
        device: torch.device | str | int | None = None,
        kernel: str = "auto",
        programs: int | None = None,
        ll_max_tokens: int | None = None,
        ll128_max_tokens: int | None = None,
    ) -> None:
        self._closed = True  # until fully constructed
        self._buf = None
        info = resolve_group(group)
        self._info = info
        self.rank, self.world_size = info.rank, info.world_size

        # -- 1. local argument checks, then agreement on them and on the geometry (every rank raises)
        problems: list[tuple[type, str]] = []

        def need_int(name: str, v, lo: int, hi: int | None = None) -> None:
            if isinstance(v, bool) or not isinstance(v, int):
                problems.append((TypeError, f"{name} must be an int, got {type(v).__name__}"))
            elif v < lo or (hi is not None and v >= hi):
                rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
                problems.append((ValueError, f"{name} must be {rng}, got {v}"))

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
        if memory not in ("auto", "vmm", "symm", "host"):
            problems.append((ValueError, f"memory must be one of ('auto', 'vmm', 'symm', 'host'), got {memory!r}"))
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
        ll = default_ll_max_tokens(heads_per_rank, head_dim, dtype) if ll_max_tokens is None else ll_max_tokens
        cuda_opts = TUNING["cuda_opts"]
        if not isinstance(cuda_opts, (tuple, list, set, frozenset)) or not all(o in _CUDA_OPTS for o in cuda_opts):
            problems.append(
                (ValueError, f"TUNING['cuda_opts'] must be a tuple of names from {_CUDA_OPTS}, got {cuda_opts!r}")
            )
            cuda_opts = ()
        cuda_opts = tuple(sorted(set(cuda_opts)))
        exclusive = (
            ("ll128", "tight_grid"), ("ll128", "chunked"), ("chunked", "early_load"), ("sentinel", "tight_grid"),
            ("sentinel", "chunked"),
        )  # fmt: skip
        for a, b in exclusive:
            if a in cuda_opts and b in cuda_opts:
                problems.append((ValueError, f"TUNING['cuda_opts']: {a!r} and {b!r} exclude each other"))
        if "split_roles" in cuda_opts and "chunked" not in cuda_opts:
            problems.append((ValueError, "TUNING['cuda_opts']: 'split_roles' applies to 'chunked' only"))
        l128, l128_min = ll128_band(ll128_max_tokens, cuda_opts, max_tokens, ll, heads_per_rank, head_dim)
        sn = (TUNING["cuda_sentinel_min_tokens"], TUNING["cuda_sentinel_split"])
        if isinstance(sn[0], bool) or not isinstance(sn[0], int) or sn[0] < 0:
            problems.append((ValueError, f"TUNING['cuda_sentinel_min_tokens'] must be an int >= 0, got {sn[0]!r}"))
        if not _split_table_ok(sn[1]):
            problems.append(
                (ValueError, "TUNING['cuda_sentinel_split'] must be ((bytes, publishers, loads), ...) ints >= 0 "
                 f"with bytes increasing and loads 1 or 2, got {sn[1]!r}")
            )  # fmt: skip
            sn = (sn[0], ())
        sn = (sn[0], tuple(tuple(entry) for entry in sn[1]))
        if "sentinel" not in cuda_opts or not isinstance(sn[0], int) or sn[0] >= max_tokens:
            sn = None  # no call would use it
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
            "ll_max_tokens", "TUNING['cuda_opts']", "ll128_max_tokens", "TUNING['cuda_ll128_min_tokens']",
            "TUNING['cuda_sentinel_*']",
        )  # fmt: skip
        diff = [n for i, n in enumerate(names) if len({g[1][i] for g in gathered}) != 1]
        if diff:
            detail = ", ".join(f"{n}: {[g[1][names.index(n)] for g in gathered]}" for n in diff)
            raise ValueError(f"OutputReducer: ranks disagree on {detail} (by rank)")

        self.max_tokens, self.heads, self.head_dim, self.dtype = max_tokens, heads_per_rank, head_dim, dtype
        self.lse_base, self.timeout_s, self.device = base, float(timeout_s), dev
        self._base2 = base == "2"
        self._mech = mechanism_code("output")
        self.memory: str | None = None
        self.kernel: str | None = None
        self.programs: int | None = None
        self.ll_max_tokens = 0
        self.ll128_max_tokens = 0

        # -- 2. backend (auto: direct when peer memory is eligible)
        if backend in ("a2a", "ag_rs"):
            self.backend, self.reason = backend, f"{backend} requested"
        elif backend == "auto" and info.world_size < 2:
            self.backend, self.reason = "a2a", "world size 1: nothing to exchange, a2a (a local copy + combine)"
        else:
            try:
                kind, why = choose_memory(info, memory, dev)
            except PeerSetupError as e:
                if backend == "direct":
                    raise
                self.backend, self.reason = "a2a", f"peer memory not eligible ({e}); falling back to a2a"
            else:
                self.backend, self.memory = "direct", kind
                self.reason = f"direct over {kind} memory" + (f" ({why})" if why else "")
        self.cuda_opts: tuple[str, ...] = ()
        if self.backend == "direct":
            try:
                self._setup_direct(kernel, programs, ll, cuda_opts, l128, l128_min, sn)
            except PeerSetupError as e:  # (on every rank alike: allocation is all-or-nothing)
                if backend != "auto":
                    raise
                # eligible by the probe, yet the allocation failed (a container's private /dev/shm, a full one,
                # a refused handle exchange): auto falls back as it does for an ineligible memory
                if self._buf is not None:  # (set to None before the backend choice)
                    self._buf.close()
                    self._buf = None
                self.backend, self.memory, self.kernel, self.programs, self.cuda_opts = "a2a", None, None, None, ()
                self.ll_max_tokens = self.ll128_max_tokens = 0
                self.reason = f"peer memory allocation failed ({e}); falling back to a2a"
        self._closed = False

    # ------------------------------------------------------------------------------------ setup
    def _setup_direct(
        self,
        kernel: str,
        programs: int | None,
        ll_max_tokens: int,
        cuda_opts: tuple = (),
        ll128_max_tokens: int = 0,
        ll128_min_tokens: int = 0,
        sentinel: tuple[int, tuple] | None = None,
    ) -> None:
        info, dev, W = self._info, self.device, self.world_size
        gpu = on_gpu(dev)
        err: BaseException | None = None
        choice, limit, hpu, sms = "triton", None, None, 1
        mask = 0  # the CUDA kernel's variant bits (ops.OPTS), kept when the CUDA kernel is chosen
        try:
            if gpu:
                sms = num_sms(dev.index)
                want = DIRECT_KERNEL_DEFAULT if kernel == "auto" else kernel
                cuda_ok = self.head_dim % 8 == 0 and W <= 8 and self.max_tokens * W * self.heads * self.head_dim < 2**34
                if want == "cuda" and not cuda_ok:
                    if kernel == "cuda":
                        raise ValueError(
                            "kernel='cuda' needs head_dim % 8 == 0, world size <= 8 and "
                            "max_tokens*W*H*D < 2**34; use kernel='triton'"
                        )
                    want = "triton"
                if want == "cuda":
                    from . import ops

                    try:
                        with torch.cuda.device(dev):
                            mask = ops.opts_mask(c for c in cuda_opts if c != "sentinel" or sentinel)
                            mask |= ops.OPTS["ll128"] if ll128_max_tokens else 0
                            per_sm = ops.blocks_per_sm(W, self.dtype, dev.index, opts=mask)
                            block = ops.cuda_block()
                        if per_sm < 1:
                            raise RuntimeError("the CUDA kernel cannot be resident on this device")
                        limit = per_sm * sms
                        choice = "cuda"
                        hpu = max(1, min(self.heads, block // (self.head_dim // 8)))
                    except Exception as e:  # noqa: BLE001 - a failed build falls back on every rank (below)
                        if kernel == "cuda":
                            raise
                        self.reason += f"; CUDA kernel unavailable ({type(e).__name__}: {e}), Triton kernel used"
                if choice == "triton":
                    limit = sms  # one 4-warp program per SM always fits
            elif kernel == "cuda":
                raise ValueError("kernel='cuda' needs CUDA tensors; CPU uses the Triton kernel (interpreter)")
        except BaseException as e:  # noqa: BLE001
            err = e
        if isinstance(err, ValueError):  # a configuration error: the same on every rank (arguments agreed)
            raise err
        agree(info, err, "OutputReducer kernel selection")
        choices = all_gather_object(info, (choice, limit))
        if len({c for c, _ in choices}) != 1:  # one rank could not build the CUDA kernel: all use Triton
            choice, hpu = "triton", None
            limits = [sms for _ in choices]
            self.reason += "; ranks differ in CUDA kernel availability, Triton kernel used on all"
        else:
            limits = [lim for _, lim in choices]
        if gpu:
            per_sm = TUNING["cuda_programs_per_sm"] if choice == "cuda" else TUNING["triton_programs_per_sm"]
            G = min(min(x for x in limits if x), per_sm * sms)
            G = min(G, min(all_gather_object(info, G)))
            if programs is not None:
                if programs > G:
                    agree(info, f"programs={programs} exceeds the co-resident limit {G} on this device", "programs")
                G = programs
        else:
            G = programs if programs is not None else TUNING["interpreter_programs"]
        self.kernel, self.programs = choice, G
        if choice == "cuda":
            self._hpu = hpu
        else:
            target = TUNING["triton_unit_elems_gpu"] if gpu else TUNING["triton_unit_elems_cpu"]
            self._hpu = K.heads_per_unit(self.heads, self.head_dim, target)
        self.ll_max_tokens = min(ll_max_tokens, self.max_tokens) if choice == "cuda" else 0
        self.cuda_opts = cuda_opts if choice == "cuda" else ()
        self.ll128_max_tokens = ll128_max_tokens if choice == "cuda" else 0
        self._ll128_min = ll128_min_tokens if self.ll128_max_tokens else 0
        self._opts_mask = mask if choice == "cuda" else 0
        self.reason += f"; {choice} kernel, {G} programs" + (
            f", LL protocol for T <= {self.ll_max_tokens}" if self.ll_max_tokens else ""
        )
        if self.ll128_max_tokens:
            lo = max(self.ll_max_tokens, self._ll128_min)
            self.reason += f", LL128 for {lo} < T <= {self.ll128_max_tokens}"
        # sentinel kernel: calls with T > sn_min; split roles by the table (publishers >= G: every CTA both)
        self._sn = choice == "cuda" and sentinel is not None
        self._sn_min, self._sn_split = sentinel if self._sn else (0, ())
        elem = torch.empty((), dtype=self.dtype).element_size()  # bytes per element: split table and layout
        self._sn_split = sentinel_split_tokens(self._sn_split, self.heads * self.head_dim * elem, G)
        if self._sn:
            lo = max(self._sn_min, self.ll_max_tokens)
            self.reason += f", sentinel kernel for T > {lo}"
            if self._sn_split:
                self.reason += (
                    " (publisher CTAs " + ", ".join(f"{n} x {u} loads for T > {t}" for t, n, u in self._sn_split) + ")"
                )
        if self.cuda_opts:
            self.reason += f", kernel variants {'+'.join(self.cuda_opts)}"

        self._layout = K.InboxLayout(
            W, G, self.max_tokens, self.heads, self.head_dim, elem, self.ll_max_tokens,
            ll128_tokens=self.ll128_max_tokens, sn_tokens=self.max_tokens if self._sn else 0,
        )  # fmt: skip
        self._buf = allocate(self._layout.nbytes, info.group, memory=self.memory, device=dev)
        if self._sn:  # the sentinel region's rest state (every byte 0xFF), before any peer can publish into it
            self._buf.fill_collective(self._layout.sn_off, self._layout.sn_payload_bytes, 0xFF)
        local_err = None
        try:
            self._epochs = torch.zeros(G, dtype=torch.int64, device=dev)
            self._err = ErrorWord(dev, self.timeout_s)
            self._timeout_ns = int(self.timeout_s * 1e9)
            self._max_spins = spin_budget(self.timeout_s, dev)
            self._gpu = gpu
            self._dummy_lse = torch.empty(1, dtype=torch.float32, device=dev)
            if choice == "cuda":
                from .ops import DirectLauncher

                self._launch_cuda = DirectLauncher(
                    peer_addrs=self._buf.peer_addrs,
                    epochs=self._epochs,
                    err_addr=self._err.kernel_arg(),
                    rank=self.rank,
                    heads=self.heads,
                    head_dim=self.head_dim,
                    max_tokens=self.max_tokens,
                    programs=G,
                    heads_per_unit=self._hpu,
                    lse_off=self._layout.lse_off,
                    payload_off=self._layout.payload_off,
                    timeout_ns=self._timeout_ns,
                    base2=self._base2,
                    dtype=self.dtype,
                    mech=self._mech,
                    device=dev.index,
                    ll_off=self._layout.ll_off,
                    ll_max_tokens=self.ll_max_tokens,
                    opts=self._opts_mask,
                    ll128_off=self._layout.ll128_off,
                    ll128_max_tokens=self.ll128_max_tokens,
                    ll128_min_tokens=self._ll128_min,
                    sn_off=self._layout.sn_off,
                    sn_lse_off=self._layout.sn_lse_off,
                    sn_min_tokens=self._sn_min,
                    sn_split=self._sn_split,
                )
        except Exception as e:  # noqa: BLE001 - (out of device / pinned memory on this rank: agreed below)
            local_err = e
        agree_or_release(info, local_err, "OutputReducer set-up after the allocation", self._buf)

    # --------------------------------------------------------------------------------- checks
    def _timeout_error(self) -> PeerTimeoutError:
        # the Output kernels store the call's flag word (epoch * TOKEN_SPACE + token) as the epoch
        w = [int(x) for x in self._err.words[:5]]
        return PeerTimeoutError(w[1], w[2], "output", w[4] // K.TOKEN_SPACE, self.timeout_s)

    def _validate(self, partial_out, partial_lse, return_lse) -> int:
        W, H, D = self.world_size, self.heads, self.head_dim
        if not isinstance(partial_out, torch.Tensor):
            raise TypeError(f"partial_out must be a torch.Tensor, got {type(partial_out).__name__}")
        if not isinstance(partial_lse, torch.Tensor):
            raise TypeError(f"partial_lse must be a torch.Tensor, got {type(partial_lse).__name__}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if partial_out.dtype != self.dtype:
            raise TypeError(f"partial_out must be {self.dtype} (the reducer's dtype), got {partial_out.dtype}")
        if partial_lse.dtype != torch.float32:
            raise TypeError(f"partial_lse must be torch.float32, got {partial_lse.dtype}")
        if partial_out.dim() != 3 or partial_out.shape[1] != W * H or partial_out.shape[2] != D:
            raise ValueError(f"partial_out must be [T, W*H={W * H}, D={D}], got {list(partial_out.shape)}")
        T = partial_out.shape[0]
        if self.max_tokens < T:
            raise ValueError(f"partial_out has T={T} tokens, more than max_tokens={self.max_tokens}")
        if tuple(partial_lse.shape) != (T, W * H):
            raise ValueError(f"partial_lse must be [T={T}, W*H={W * H}], got {list(partial_lse.shape)}")
        for name, t in (("partial_out", partial_out), ("partial_lse", partial_lse)):
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device} (the reducer's device), got {t.device}")
            if T > 0 and not t.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous (token-major, packed heads), got strides {tuple(t.stride())}; "
                    f"call .contiguous() first"
                )
        if self.kernel == "cuda" and T > 0 and partial_out.data_ptr() % 16:
            raise ValueError(
                "partial_out must be 16-byte aligned for the CUDA kernel "
                f"(data_ptr % 16 = {partial_out.data_ptr() % 16})"
            )
        return T

    # ---------------------------------------------------------------------------------- reduce
    def reduce(
        self, partial_out: torch.Tensor, partial_lse: torch.Tensor, *, return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Combine every rank's partial for this rank's heads.

        Args:
            partial_out: ``[T, W*H, D]`` in the reducer's dtype, contiguous; widened heads rank-major
                (head ``s*H + h`` belongs to rank s). Rows of an empty shard may hold anything (NaN).
            partial_lse: ``[T, W*H]`` fp32, contiguous; NaN / +inf / -inf mark an empty shard.
            return_lse: also return the merged LSE.

        Returns:
            ``out [T, H, D]`` (heads ``[rank*H, (rank+1)*H)``; 0 where every source is empty), and with
            ``return_lse`` the merged ``lse [T, H]`` fp32 (-inf where every source is empty).

        Every rank must make the same calls with the same T. Capturable in a CUDA graph (no host sync,
        outputs allocated from the graph's pool).
        """
        self._ready("reduce")
        T = self._validate(partial_out, partial_lse, return_lse)
        H, D = self.heads, self.head_dim
        out = torch.empty((T, H, D), dtype=self.dtype, device=self.device)
        out_lse = torch.empty((T, H), dtype=torch.float32, device=self.device) if return_lse else None
        if T > 0:
            if self.backend == "direct":
                self._direct(partial_out, partial_lse, out, out_lse, T)
            elif self.backend == "a2a":
                self._a2a(partial_out, partial_lse, out, out_lse, T)
            else:
                self._ag_rs(partial_out, partial_lse, out, out_lse, T)
        return (out, out_lse) if return_lse else out

    __call__ = reduce

    def _direct(self, po, pl, out, out_lse, T) -> None:
        if self.kernel == "cuda":
            if torch.compiler.is_compiling():
                L = self._layout
                torch.ops.peerdcp.output_direct(
                    po, pl, out, out_lse if out_lse is not None else self._dummy_lse, self._epochs,
                    self._buf.peer_addrs, self._err.kernel_arg(), self.rank, self.programs, self._hpu,
                    self.max_tokens, L.lse_off, L.payload_off, self._timeout_ns, self._base2,
                    out_lse is not None, self._mech, L.ll_off, self.ll_max_tokens, self._opts_mask, L.ll128_off,
                    self.ll128_max_tokens, self._ll128_min, L.sn_off, L.sn_lse_off, self._sn_min,
                    [x for entry in self._sn_split for x in entry],
                )  # fmt: skip
            else:
                self._launch_cuda(po, pl, out, out_lse)
            return
        W, H, D, G = self.world_size, self.heads, self.head_dim, self.programs
        K.direct_kernel[(G,)](
            po, pl, out, out_lse if out_lse is not None else self._dummy_lse,
            self._buf.peer_ptrs, self._epochs, self._err.kernel_arg(),
            T, self.rank, G, self.max_tokens, self._layout.lse_off, self._layout.payload_off,
            self._timeout_ns, self._max_spins,
            W=W, H=H, D=D, HB=self._hpu, BLOCK_D=triton.next_power_of_2(D), NC=triton.cdiv(H, self._hpu),
            BASE2=self._base2, RETURN_LSE=out_lse is not None, MECH=self._mech, GPU=self._gpu,
        )  # fmt: skip
        if not self._gpu:  # the interpreter ran synchronously: report a timeout now
            self._ready("reduce")

    def _collective(self, op, out: torch.Tensor, inp: torch.Tensor) -> None:
        """One collective of the a2a / ag_rs backends: on CPU tensors over the gloo group, bounded by ``timeout_s``
        (a missing peer: PeerTimeoutError, and the reducer refuses further calls); on the GPU over the caller's group
        (NCCL: the process group's timeout)."""
        group = self._info.group if self.device.type == "cuda" else self._info.cpu_group
        try:
            bounded_collective(op, out, inp, group=group, timeout_s=self.timeout_s, rank=self.rank, mechanism="output")
        except PeerTimeoutError as e:
            self._failure = e
            raise

    def _combine_args(self, H: int, D: int) -> tuple[int, int]:
        target = TUNING["triton_unit_elems_gpu"] if self.device.type == "cuda" else TUNING["triton_unit_elems_cpu"]
        hb = K.heads_per_unit(H, D, target)
        return hb, triton.next_power_of_2(D)

    def _a2a(self, po, pl, out, out_lse, T) -> None:
        W, H, D = self.world_size, self.heads, self.head_dim
        pb = H * D * po.element_size()
        rb = -(-(pb + 4 * H) // 16) * 16  # one row per (peer, token): payload then LSE, 16-byte rows
        send = torch.empty((W, T, rb), dtype=torch.uint8, device=self.device)
        recv = torch.empty_like(send)
        send[:, :, :pb].view(self.dtype).unflatten(-1, (H, D)).copy_(po.view(T, W, H, D).transpose(0, 1))
        send[:, :, pb : pb + 4 * H].view(torch.float32).copy_(pl.view(T, W, H).transpose(0, 1))
        self._collective(dist.all_to_all_single, recv.view(-1), send.view(-1))
        rp = recv[:, :, :pb].view(self.dtype).unflatten(-1, (H, D))  # [W, T, H, D]
        rl = recv[:, :, pb : pb + 4 * H].view(torch.float32)  # [W, T, H]
        hb, bd = self._combine_args(H, D)
        K.combine_kernel[(T, triton.cdiv(H, hb))](
            rp, rl, out, out_lse if out_lse is not None else self._dummy(),
            rp.stride(0), rp.stride(1), rp.stride(2), rl.stride(0), rl.stride(1), rl.stride(2),
            N=W, H=H, D=D, HB=hb, BLOCK_D=bd, BASE2=self._base2, RETURN_LSE=out_lse is not None,
            GPU=on_gpu(self.device),
        )  # fmt: skip

    def _ag_rs(self, po, pl, out, out_lse, T) -> None:
        W, H, D = self.world_size, self.heads, self.head_dim
        lses = torch.empty((W, T, W * H), dtype=torch.float32, device=self.device)
        self._collective(_AG, lses.view(-1), pl.view(-1))
        corrected = torch.empty((W, T, H, D), dtype=torch.float32, device=self.device)
        hb, bd = self._combine_args(H, D)
        K.correct_kernel[(T, W * triton.cdiv(H, hb))](
            po, lses, corrected, out_lse if out_lse is not None else self._dummy(), T, self.rank,
            W=W, H=H, D=D, HB=hb, BLOCK_D=bd, BASE2=self._base2, RETURN_LSE=out_lse is not None,
            GPU=on_gpu(self.device),
        )  # fmt: skip
        red = torch.empty((T, H, D), dtype=torch.float32, device=self.device)
        self._collective(_RS, red.view(-1), corrected.view(-1))
        out.copy_(red)

    def _dummy(self) -> torch.Tensor:
        d = getattr(self, "_dummy_lse", None)
        if d is None:
            d = self._dummy_lse = torch.empty(1, dtype=torch.float32, device=self.device)
        return d

    def __repr__(self) -> str:
        return (
            f"OutputReducer(backend={self.backend!r}, memory={self.memory!r}, kernel={self.kernel!r}, "
            f"W={self.world_size}, H={self.heads}, D={self.head_dim}, dtype={self.dtype}, "
            f"max_tokens={self.max_tokens}, lse_base={self.lse_base!r}, closed={self._closed})"
        )
