"""Exact global Top-K over owner-sharded tokens: local canonical candidates, exchanged and merged.

Lifecycle::

    tk = peerdcp.TopK(group, max_rows=128, topk=2048)          # collective: allocates peer memory
    ids = tk.select(local_logits, seq_lens)                      # [T, 2048] int32, identical on every rank
    rows, counts = tk.owned(ids)                                 # this rank's local rows, compacted
    tk.close()                                                   # collective, idempotent

**Why it is exact** (notes/dsa-query-topk.md section 4.5). Every rank orders its tokens by the canonical
key (score descending, then global id ascending; NaN lowest; -0 == +0) and keeps its first ``k``. An
element of the global top-k has fewer than ``k`` elements ahead of it globally, hence fewer than ``k`` ahead
on its own rank, so it survives the local cut; the global top-k is the top-k of the ``W*k`` candidates.
Keys are unique int64 (``ordered(score) << 31 | (2^31 - 1 - gid)``), so the local top-k is ``torch.topk``
on keys and the merge of the W sorted lists places ``list_a[j]`` at ``j + sum_{b != a} #{list_b > x}``.

**Direct protocol** (``backend="direct"``; ``T <= max_rows``). Every rank's buffer holds flags
``int64 [2, W, max_rows]`` and an inbox ``int64 [2, W, max_rows, k]``. Each row t has its own epoch in
local device memory (the number of calls that carried row t), advanced by the publish kernel's program t,
so back-to-back calls and CUDA-graph replays need no host synchronization and no atomics.

1. publish kernel, program t: ``e = ++epoch[t]``; store row t's candidates into every peer's inbox
   ``[e % 2, rank, t]``, fence (system scope), release the peer's flag ``[e % 2, rank, t] = e``;
   pre-fill ``out[t]`` with -1;
2. merge kernel, program (t, chunk, list): acquire-wait (bounded) for every peer's flag of row t, then
   binary-search the inbox (loads bypass L1) and scatter the ids. A wait that times out writes the error
   word and the program skips the data; the next call (or ``check()``) raises ``PeerTimeoutError``.

``select()`` on a GPU (the CUDA selection and merge, ``ops.TUNING["select_publish"]``) runs step 1 inside the
selection kernel: the CTA that stored row t's candidates publishes them right after (``publish_row`` in
``csrc/topk/select.cu``; the -1 pre-fill is the Triton merge's only), one launch less. ``merge()`` called
alone always launches the publish kernel. Both advance the same epochs, so the two paths mix freely.

Publishing and waiting are separate kernels, so no program ever waits for work of its own GPU that is
not yet scheduled (neither the publish kernel nor the selection kernel ever waits).

Why two parity slots suffice: rank r overwrites row t of slot ``e % 2`` in peer p's inbox at row epoch
e+2, in a publish (or selection) kernel that follows (stream order) its merge kernel of row epoch e+1; that merge waited
for p's flag of row epoch e+1, which p's publish kernel released after p's merge kernel of row epoch e -
the only reader of that inbox row - completed (stream order on p). The same chain shows a flag is never
overwritten with e+2 before it was read as e.

``backend="allgather"`` (and every call with ``T > max_rows``): the same candidates, padded to ``k``, go
through ``all_gather_into_tensor`` on the group, then the same merge kernel.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import triton

from .._runtime.checks import cuda_index, is_int, resolve_device, timeout_problem
from .._runtime.device import ErrorWord, mechanism_code, on_gpu, spin_budget
from .._runtime.groups import agree_args, agree_or_release, all_gather_object, bounded_collective, resolve_group
from .._runtime.lifecycle import Collective
from ..errors import PeerSetupError, PeerTimeoutError
from ..memory import MEMORY_KINDS, allocate, choose_memory
from . import ops
from . import reference as ref
from .kernels import _keys_kernel, _merge_kernel, _owned_kernel, _publish_kernel

__all__ = ["TopK", "canonical_topk", "BACKENDS", "MAX_TOPK"]

BACKENDS = ("auto", "direct", "allgather")
MAX_TOPK = 1 << 16
_MAX_SEQ = (1 << 31) - 1  # ids are int32 and the key keeps 31 id bits


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _cuda_select_ok(device: torch.device, n: int, L: int) -> bool:
    """Whether ``_local_keys`` takes the CUDA selection (``ops.select``) for ``n`` of ``L`` keys on ``device``."""
    if ops.TUNING["local_select"] != "auto" or not on_gpu(device) or L >= (1 << 31) - (1 << 14):
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


def buffer_layout(W: int, max_rows: int, topk: int) -> tuple[int, int]:
    """The direct protocol's per-rank buffer: (word offset of the inbox ``int64 [2, W, max_rows, topk]``, total
    int64 words). Flags ``int64 [2, W, max_rows]`` first, the inbox 256-byte aligned after them."""
    inbox = -(-2 * W * max_rows // 32) * 32
    return inbox, inbox + 2 * W * max_rows * topk


def _uses_cuda_select(device: torch.device, k: int, L: int) -> bool:
    """Whether :func:`_local_keys` takes the CUDA selection (the only path that can publish) for top ``k`` of ``L``
    local columns on ``device``."""
    return L > 0 and _cuda_select_ok(device, min(k, L), L)


def _local_keys(local_logits, seq_lens, k, rank, W, I, force_first, force_last, publish=None) -> torch.Tensor:
    """``int64 [T, max(1, min(k, L))]``: this rank's canonical candidates, keys descending, -1 tail.

    On a GPU, ``csrc/topk/select.cu`` computes the keys from the scores and selects them in one kernel (radix
    select + shared-memory sort; one CTA per row, or a cluster of up to 8 per row at few rows) for n = min(k, L)
    <= 2048; otherwise (and in the interpreter) the Triton ``_keys_kernel`` writes every key and ``torch.topk`` /
    ``torch.sort`` picks them. Same output. ``publish`` (an ``ops.Publish``; only where :func:`_uses_cuda_select`):
    the selection kernel also publishes each row to the direct Top-K's peers."""
    T, L = local_logits.shape
    dev = local_logits.device
    if L == 0:
        return torch.full((T, 1), -1, dtype=torch.int64, device=dev)
    n = min(k, L)
    if publish is not None or _uses_cuda_select(dev, k, L):  # (a publishing caller checked it)
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


MERGE_IMPLS = ("auto", "cuda", "triton")


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


def _merge_lists(out: torch.Tensor, lists: torch.Tensor, W: int, k: int, impl: str = "triton") -> None:
    """Merge ``lists [W, T, n]`` (each row sorted, -1 tail) into ``out [T, k]`` (no peers involved)."""
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
) -> torch.Tensor:
    """Single-rank canonical top-k (the replicated-index baseline; no communication).

    Args:
        logits: ``[T, L]`` fp32 scores by global token id (entries at or past a row's length ignored).
        seq_lens: ``[T]`` int32/int64 sequence lengths.
        topk: tokens kept per row.
        force_first, force_last: the first / last this many tokens of each row are scored +inf.

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
    keys = _local_keys(logits, seq_lens, topk, 0, 1, 1, force_first, force_last)
    _merge_lists(out, keys[None], 1, topk)
    return out


class TopK(Collective):
    """Exact canonical global top-k over tokens sharded across a DCP group.

    Args:
        group: the DCP ``ProcessGroup`` (None = default). Construction is collective; every rank must pass
            the same ``max_rows``, ``topk``, ``backend``, ``memory``, ``interleave`` (else ``ValueError``).
        max_rows: the most rows one direct call carries (sizes the inboxes); larger calls use allgather.
        topk: tokens kept per row (DeepSeek-V3.2 / GLM-5: 2048), 1 .. 65536.
        backend: ``"direct"`` (peer-memory candidate exchange; SGLang calls this route ``vmm``),
            ``"allgather"`` (``all_gather_into_tensor`` of the candidates) or ``"auto"`` (direct when peer
            memory is eligible on every rank, else allgather; :attr:`reason` says why).
        memory: ``"auto"``, ``"vmm"``, ``"symm"`` or ``"host"`` (CPU tensors, for CI).
        interleave: ownership interleave I (DESIGN.md section 3); must equal the index cache's.
        timeout_s: bound on every wait of the direct exchange for a peer, in seconds (0 < timeout_s <= 1e6); past
            it the call is abandoned and ``PeerTimeoutError`` is raised by the next call or :meth:`check`. The
            all-gather (``backend="allgather"``, and rows beyond ``max_rows`` on any backend) is bounded by it on
            CPU tensors (gloo: ``PeerTimeoutError`` at once); on the GPU it waits as NCCL does: a missing peer
            there ends in the process group's own timeout and error.
        device: CUDA device (default: current) or ``"cpu"`` (default when ``memory="host"`` or no CUDA).
        merge_impl: merge kernel, ``"auto"`` (CUDA C++ on a GPU when it builds and fits, else Triton),
            ``"cuda"`` or ``"triton"``; both give the same ids. Local to each rank (:attr:`merge_impl`).

    Peer memory per rank (direct): ``16*W*max_rows*(topk + 1)`` bytes.
    """

    def __init__(
        self,
        group=None,
        *,
        max_rows: int,
        topk: int = 2048,
        backend: str = "auto",
        memory: str = "auto",
        interleave: int = 1,
        timeout_s: float = 10.0,
        device: torch.device | str | int | None = None,
        merge_impl: str = "auto",
    ) -> None:
        # the arguments are checked on every rank, then agreed: a rank with a bad one raises its error and every
        # other rank a PeerSetupError naming it (none waits for it in the next collective)
        local_err: BaseException | None = None
        dev = None
        try:
            if not is_int(max_rows):
                raise TypeError(f"TopK: max_rows must be an int, got {type(max_rows).__name__}")
            if max_rows < 1:
                raise ValueError(f"TopK: max_rows must be >= 1, got {max_rows}")
            if not is_int(topk):
                raise TypeError(f"TopK: topk must be an int, got {type(topk).__name__}")
            if not 1 <= topk <= MAX_TOPK:
                raise ValueError(f"TopK: topk must be in [1, {MAX_TOPK}], got {topk}")
            if backend not in BACKENDS:
                raise ValueError(f"TopK: backend must be one of {BACKENDS}, got {backend!r}")
            if memory not in MEMORY_KINDS:
                raise ValueError(f"TopK: memory must be one of {MEMORY_KINDS}, got {memory!r}")
            if not is_int(interleave):
                raise TypeError(f"TopK: interleave must be an int, got {type(interleave).__name__}")
            if interleave < 1:
                raise ValueError(f"TopK: interleave must be >= 1, got {interleave}")
            bad_timeout = timeout_problem(timeout_s)
            if bad_timeout:
                raise ValueError(f"TopK: {bad_timeout}")
            if merge_impl not in MERGE_IMPLS:
                raise ValueError(f"TopK: merge_impl must be one of {MERGE_IMPLS}, got {merge_impl!r}")
            dev = resolve_device(device, cpu=memory == "host", owner="TopK: ")
        except (TypeError, ValueError) as e:
            local_err = e
        info = resolve_group(group, local_err)
        agree_args(info, local_err, "TopK")
        # the merge kernel is local to a rank (its inbox, its flags), but an impossible request must fail on
        # every rank alike and before any peer memory exists
        try:
            merge_choice, merge_err = _choose_merge_impl(merge_impl, dev, info.world_size, topk), None
        except ValueError as e:
            merge_choice, merge_err = None, str(e)
        geo = (max_rows, topk, backend, memory, interleave, dev.type)
        gathered = all_gather_object(info, (geo, merge_err))
        errs = [(r, m) for r, (_, m) in enumerate(gathered) if m is not None]
        if errs:
            raise ValueError("; ".join(f"rank {r}: {m}" for r, m in errs))
        geos = [g for g, _ in gathered]
        if len(set(geos)) != 1:
            raise ValueError(
                f"TopK: ranks passed different (max_rows, topk, backend, memory, interleave, device type): {geos}"
            )
        self._info = info
        self.rank, self.world_size = info.rank, info.world_size
        self.max_rows, self.topk, self.interleave = max_rows, topk, interleave
        self.timeout_s = float(timeout_s)
        self.device = dev
        kind = None
        if backend == "allgather":
            why = "allgather requested"
        else:
            try:
                kind, why = choose_memory(info, memory, dev)  # collective; raises on every rank alike
            except PeerSetupError as e:
                if backend == "direct":
                    raise
                why = f"no peer memory on every rank ({e})"
        if kind is not None:
            W = self.world_size
            self._inbox_word, words = buffer_layout(W, max_rows, topk)
            self._buf = allocate(8 * words, info.group, memory=kind, device=dev)
            self.backend, self.memory = "direct", kind
            self.reason = f"direct over {kind} memory ({why}); rows > {max_rows} use allgather"
        else:
            self.backend, self.memory = "allgather", "none"
            self.reason = f"allgather: {why}"
        self.merge_impl, why_merge = merge_choice
        self.reason += f"; {why_merge}"
        local_err = None
        try:
            # state: [aborted after a timeout, epoch of row 0, ..., epoch of row max_rows - 1]
            self._state = torch.zeros(1 + max_rows, dtype=torch.int64, device=dev)
            self._err = ErrorWord(dev, self.timeout_s)
            self._spins = spin_budget(self.timeout_s, dev)
        except Exception as e:  # noqa: BLE001 - (out of device / pinned memory on this rank: agreed below)
            local_err = e
        agree_or_release(info, local_err, "TopK set-up", self._buf)  # (allgather too: its calls are collective)

    # ----------------------------------------------------------------------------------- stages
    def local_candidates(
        self,
        local_logits: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        force_first: int = 0,
        force_last: int = 0,
    ) -> torch.Tensor:
        """Stage 1 of :meth:`select`: this rank's canonical candidates, ``int64 [T, min(topk, L)]`` packed
        keys (descending, -1 tail; at least one column). No communication."""
        return self._candidates(local_logits, seq_lens, force_first, force_last, publish=False)[0]

    def _candidates(
        self, local_logits: torch.Tensor, seq_lens: torch.Tensor, force_first: int, force_last: int, *, publish: bool
    ) -> tuple[torch.Tensor, bool]:
        """:meth:`local_candidates`, and whether the selection kernel also published them to the peers (asked by
        ``publish`` and possible: direct, ``T <= max_rows``, the CUDA selection and merge; else the caller's
        :meth:`merge` publishes)."""
        self._ready("local_candidates")
        T, L = _check_logits_and_lens("TopK.select", local_logits, seq_lens, self.device)
        _check_force("TopK.select", force_first, force_last)
        _check_lengths_on_host("TopK.select", seq_lens, L, self.rank, self.world_size, self.interleave)
        pub = None
        if (
            publish
            and ops.TUNING["select_publish"]
            and self._buf is not None
            and 0 < T <= self.max_rows
            and self.merge_impl == "cuda"
            and _uses_cuda_select(self.device, self.topk, L)
        ):
            pub = ops.Publish(self._buf.peer_ptrs, self._state, self._inbox_word, self.topk, self.max_rows)
        keys = _local_keys(
            local_logits,
            seq_lens,
            self.topk,
            self.rank,
            self.world_size,
            self.interleave,
            force_first,
            force_last,
            publish=pub,
        )
        return keys, pub is not None

    def merge(self, keys: torch.Tensor) -> torch.Tensor:
        """Stage 2 of :meth:`select`: exchange every rank's candidates and merge them.

        Args:
            keys: ``int64 [T, n]`` with ``1 <= n <= topk``, as :meth:`local_candidates` returns (sorted
                descending, -1 tail, keys unique across ranks). Every rank must call with the same T.

        Returns:
            ``int32 [T, topk]`` global ids, canonical order, -1 padded; identical on every rank.
        """
        self._ready("merge")
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 2:
            raise TypeError("TopK.merge: keys must be an int64 tensor [T, n]")
        T, n = keys.shape
        if not 1 <= n <= self.topk:
            raise ValueError(f"TopK.merge: keys must have 1 to topk = {self.topk} columns, got {n}")
        if keys.device != self.device:
            raise ValueError(f"TopK.merge: keys is on {keys.device}, expected {self.device}")
        if keys.stride(1) != 1:
            raise ValueError("TopK.merge: keys rows must be contiguous")
        out = torch.empty(T, self.topk, dtype=torch.int32, device=self.device)
        if T == 0:
            return out
        if self._buf is not None and self.max_rows >= T:
            self._merge_direct(keys, out)
        else:
            self._merge_allgather(keys, out)
        return out

    def _merge_direct(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        self._publish(keys, out)
        self._merge_inbox(keys, out)
        if self.device.type == "cpu":  # host memory: the kernel already ran, report a timeout right away
            self._ready("select")

    def _publish(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        """Kernel 1 of the direct merge: advance the rows' epochs, push this rank's candidates into every
        peer's inbox, release the flags, pre-fill ``out`` with -1 (``bench.topk --breakdown`` times it alone)."""
        buf, W, K = self._buf, self.world_size, self.topk
        T, n = keys.shape
        gpu = on_gpu(self.device)
        pblock = min(triton.next_power_of_2(K), 1024) if gpu else triton.next_power_of_2(K)
        _publish_kernel[(T,)](
            keys,
            keys.stride(0),
            n,
            out,
            buf.peer_ptrs,
            self._state,
            self.rank,
            self.max_rows,
            self._inbox_word,
            W=W,
            K=K,
            BLOCK=pblock,
            FILL=self.merge_impl != "cuda",  # the CUDA merge writes every position itself
            GPU=gpu,
        )

    def _merge_inbox(
        self, keys: torch.Tensor, out: torch.Tensor, pdl: bool = False, launch_grid: tuple[int, int] | None = None
    ) -> None:
        """Kernel 2: wait for the peers' flags of each row (this call's epoch), merge into ``out``. ``pdl``
        (the CUDA merge right after a publishing selection kernel): launched with programmatic dependent launch;
        ``launch_grid``: the CUDA merge's ``ops.grid`` when the caller computed it."""
        buf, W, K = self._buf, self.world_size, self.topk
        T, n = keys.shape
        base = buf.peer_addrs[self.rank]
        if self.merge_impl == "cuda":
            ops.merge(
                out,
                own=keys.data_ptr(),
                own_stride=keys.stride(0),
                own_len=n,
                lists=base + 8 * self._inbox_word,
                slot_stride=W * self.max_rows * K,
                list_stride=self.max_rows * K,
                row_stride=K,
                list_len=K,
                flags=base,
                state=self._state.data_ptr(),
                err=self._err.kernel_arg(),
                timeout_ns=int(self.timeout_s * 1e9),
                rank=self.rank,
                world_size=W,
                topk=K,
                max_rows=self.max_rows,
                mech=mechanism_code("topk"),
                direct=True,
                pdl=pdl,
                launch_grid=launch_grid,
            )
            return
        gpu = on_gpu(self.device)
        WP = triton.next_power_of_2(W)
        BLOCK = _merge_block(K, WP, self.device)
        nch = triton.cdiv(K, BLOCK)
        _merge_kernel[(T, nch, W)](
            out,
            keys.data_ptr(),
            keys.stride(0),
            n,
            base + 8 * self._inbox_word,
            K,
            W * self.max_rows * K,
            self.max_rows * K,
            K,
            base,
            self._state,
            self._err.kernel_arg(),
            self.rank,
            self.max_rows,
            int(self.timeout_s * 1e9),
            self._spins,
            W=W,
            WP=WP,
            K=K,
            BLOCK=BLOCK,
            LOGK=K.bit_length(),
            DIRECT=True,
            MECH=mechanism_code("topk"),
            GPU=gpu,
        )

    def _merge_allgather(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        W, K = self.world_size, self.topk
        T, n = keys.shape
        if n < K:
            keys = torch.nn.functional.pad(keys, (0, K - n), value=-1)
        keys = keys.contiguous()
        gathered = torch.empty(W * T, K, dtype=torch.int64, device=self.device)  # [W*T, K]: gloo wants dim 0
        if W == 1:
            gathered.copy_(keys)
        else:
            try:
                bounded_collective(
                    _all_gather_single,
                    gathered,
                    keys,
                    group=self._info.group,
                    timeout_s=self.timeout_s,
                    rank=self.rank,
                    mechanism="topk",
                )
            except PeerTimeoutError as e:
                self._failure = e
                raise
        _merge_lists(out, gathered.view(W, T, K), W, K, self.merge_impl)

    # ----------------------------------------------------------------------------------- public
    def select(
        self,
        local_logits: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        force_first: int = 0,
        force_last: int = 0,
    ) -> torch.Tensor:
        """The exact global top-k of every row, from this rank's scores of its own tokens.

        Args:
            local_logits: ``[T, L_local_max]`` fp32; entry ``[t, l]`` scores local row ``l`` = global token
                ``global_id(l, rank)``. Entries at or past the row's local length are ignored (garbage is
                fine). ``L_local_max`` must cover every row's local length (checked for CPU tensors).
            seq_lens: ``[T]`` int32/int64 global sequence lengths in ``[0, 2^31 - 1)`` (same on every rank).
            force_first, force_last: the first / last this many tokens of each sequence are always
                selected (scored +inf; ordered among themselves by id).

        Returns:
            ``[T, topk]`` int32 global ids in canonical order (score desc, id asc, NaN lowest, -0 == +0),
            -1 padded; identical on every rank. Every rank must call with the same T and arguments.
        """
        keys, published = self._candidates(local_logits, seq_lens, force_first, force_last, publish=True)
        if not published:
            return self.merge(keys)
        out = torch.empty(keys.shape[0], self.topk, dtype=torch.int32, device=self.device)
        # (the selection kernel did _publish's work, and lets the merge kernel launch early; the merge's grid is
        # computed once for the PDL rule and the launch)
        T, dev = keys.shape[0], cuda_index(self.device)
        launch_grid = ops.grid(T, self.world_size, self.topk, dev)
        pdl = ops.merge_pdl(T, self.world_size, self.topk, dev, local_logits.shape[1], launch_grid=launch_grid)
        self._merge_inbox(keys, out, pdl=pdl, launch_grid=launch_grid)
        return out

    def owned(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a selection (for sparse attention over the local KV shard).

        Args:
            ids: ``[T, topk]`` int32 global ids (-1 = none), e.g. from :meth:`select`.

        Returns:
            ``rows [T, topk]`` int32: local rows of the owned ids, in selection order, compacted to the
            front, -1 tail; ``counts [T]`` int32 (usable as FlashMLA's ``topk_length``).
        """
        if self._closed:  # (no peer waits here: a recorded timeout does not stop a local lookup)
            raise ValueError("TopK.owned: the object is closed")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32:
            raise TypeError("TopK.owned: ids must be an int32 tensor [T, topk]")
        if ids.dim() != 2 or ids.shape[1] != self.topk:
            raise ValueError(f"TopK.owned: ids must be [T, {self.topk}], got {tuple(ids.shape)}")
        if ids.device != self.device:
            raise ValueError(f"TopK.owned: ids is on {ids.device}, expected {self.device}")
        if ids.stride(1) != 1:
            raise ValueError("TopK.owned: ids rows must be contiguous")
        T, K = ids.shape
        rows = torch.empty(T, K, dtype=torch.int32, device=self.device)
        counts = torch.empty(T, dtype=torch.int32, device=self.device)
        if T:
            _owned_kernel[(T,)](
                ids,
                ids.stride(0),
                rows,
                counts,
                self.rank,
                self.world_size,
                self.interleave,
                K,
                BLOCK=triton.next_power_of_2(K),
                num_warps=8 if self.device.type == "cuda" and K >= 1024 else 4,
            )
        return rows, counts

    def __repr__(self) -> str:
        return (
            f"TopK(backend={self.backend!r}, memory={self.memory!r}, rank={self.rank}/{self.world_size}, "
            f"topk={self.topk}, max_rows={self.max_rows}, interleave={self.interleave})"
        )
