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

``select()`` on a GPU (the CUDA selection and merge, ``TopKPolicy.select_publish``) runs step 1 inside the
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

import copy

import torch
import torch.distributed as dist
import triton

from .._runtime.checks import cuda_index, resolve_device
from .._runtime.device import ErrorWord, mechanism_code, on_gpu, spin_budget
from .._runtime.groups import agree_args, agree_or_release, all_gather_object, bounded_collective, resolve_group
from .._runtime.lifecycle import Collective
from ..errors import PeerSetupError, PeerTimeoutError
from ..memory import allocate, choose_memory
from . import ops
from . import policy as pol
from .candidates import (
    MAX_TOPK,
    _check_force,
    _check_lengths_on_host,
    _check_logits_and_lens,
    _choose_merge_impl,
    _local_keys,
    _merge_block,
    _merge_lists,
    _uses_cuda_select,
    canonical_topk,
)
from .config import BACKENDS, buffer_layout, check_args
from .kernels import _merge_kernel, _owned_kernel, _publish_kernel
from .policy import TopKPolicy

# (canonical_topk, _local_keys, _merge_lists live in .candidates; importable from here as before)
__all__ = ["TopK", "canonical_topk", "BACKENDS", "MAX_TOPK", "buffer_layout"]


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
        policy: the selection's and the merge's launch rules (:class:`~peerdcp.topk.policy.TopKPolicy`; None:
            :func:`~peerdcp.topk.policy.default_policy`). Local to each rank: the ids never depend on it.

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
        policy: TopKPolicy | None = None,
    ) -> None:
        # the arguments are checked on every rank, then agreed: a rank with a bad one raises its error and every
        # other rank a PeerSetupError naming it (none waits for it in the next collective)
        local_err: BaseException | None = None
        dev = None
        try:
            check_args(max_rows, topk, backend, memory, interleave, timeout_s, merge_impl, policy)
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
        self._set_policy(pol.default_policy() if policy is None else policy)
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

    def _set_policy(self, policy: TopKPolicy) -> None:
        self._policy = policy
        # the selection kernel may publish (direct, the CUDA merge, the policy's select_publish); per call it also
        # needs T <= max_rows and the CUDA selection for the call's width
        self._may_publish = bool(policy.select_publish) and self._buf is not None and self.merge_impl == "cuda"

    def _with_policy(self, policy: TopKPolicy) -> TopK:
        """Tests and benchmarks only: a view of this object - the same buffer, epochs and error word, so its calls
        interleave with this object's as one object's would - whose calls follow ``policy``. Close the original
        (the view does not own the resources)."""
        view = copy.copy(self)
        view._set_policy(policy)
        return view

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
            and self._may_publish
            and 0 < T <= self.max_rows
            and _uses_cuda_select(self.device, self.topk, L, policy=self._policy)
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
            policy=self._policy,
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
        ``launch_grid``: the CUDA merge's ``policy.grid`` when the caller computed it."""
        buf, W, K = self._buf, self.world_size, self.topk
        T, n = keys.shape
        base = buf.peer_addrs[self.rank]
        if self.merge_impl == "cuda":
            if launch_grid is None:
                launch_grid = pol.grid(T, W, K, cuda_index(self.device), policy=self._policy)
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
        _merge_lists(out, gathered.view(W, T, K), W, K, self.merge_impl, policy=self._policy)

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
        W, K, length, p = self.world_size, self.topk, local_logits.shape[1], self._policy
        launch_grid = pol.grid(T, W, K, dev, policy=p)
        pdl = pol.merge_pdl(T, W, K, dev, length, launch_grid=launch_grid, policy=p)
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
