"""Functions run on every rank by tests/test_collective_timeout.py (module-level so spawn can pickle them): the
collective backends (Output a2a / ag_rs, Query allgather, Top-K allgather) on CPU tensors with a missing peer."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

import peerdcp
from on_ranks.output import make_inputs as output_inputs
from on_ranks.query import make_inputs as query_inputs
from on_ranks.topk import shard, tie_logits
from peerdcp.errors import PeerTimeoutError
from peerdcp.query.rope import plain_cos_sin_cache


def _object(kind: str, group, timeout_s: float) -> tuple[object, Callable[[], object]]:
    """(the object, one call of it with fixed inputs) for ``kind`` = ``"output-a2a"`` | ``"output-ag_rs"`` |
    ``"query"`` | ``"topk"``, every one on its collective backend over ``group``."""
    W, me = dist.get_world_size(group), dist.get_rank(group)
    common = dict(timeout_s=timeout_s, device="cpu")
    if kind.startswith("output-"):
        red = peerdcp.OutputReducer(group, max_tokens=2, heads_per_rank=2, head_dim=16, backend=kind[7:], **common)
        outs, lses = output_inputs(5, W, 2, 2, 16, red.dtype)
        return red, lambda: red.reduce(outs[me], lses[me])
    if kind == "query":
        qg = peerdcp.QueryGather(group, max_tokens=2, heads_per_rank=2, backend="allgather", **common)
        nopes, pes, pos = query_inputs(3, W, 2, 2, qg.nope_dim, qg.rope_dim, 64)
        cs = plain_cos_sin_cache(64, qg.rope_dim)
        return qg, lambda: qg.gather(nopes[me], pes[me], pos, cs)
    if kind == "topk":
        K = 8
        tk = peerdcp.TopK(group, max_rows=2, topk=K, backend="allgather", **common)
        lens = torch.tensor([3 * K, 5], dtype=torch.int64)
        local = shard(tie_logits(2, 3 * K, 11), lens, me, W, 1, 0, 11)
        return tk, lambda: tk.select(local, lens)
    raise ValueError(kind)


def _outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
        return "no error"
    except PeerTimeoutError as e:
        return f"rank={e.rank} peer={e.peer} mech={e.mechanism}"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"


def missing_peer(kind: str, absent: int, timeout_s: float, gone: bool = False) -> dict:
    """Rank ``absent`` calls late (after the others' bound ran out). The others must raise PeerTimeoutError (peer
    -1: a collective names no rank) after about ``timeout_s``, never torch's own wait, then refuse later calls
    without starting a collective. The late call meets their pending collective and completes (not made for
    ``ag_rs``, whose second collective nobody else makes: gloo's reduce-scatter waits for the group's timeout).

    ``gone``: rank ``absent`` leaves the group instead (destroys it, as a process that died would close its
    connections): the others get torch's own error at once, not a PeerTimeoutError after the bound.

    The object runs on a gloo group of its own: after the timeout it carries a pending collective (as documented),
    so the ranks meet on the pool's group instead, then destroy it."""
    me = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    obj, call = _object(kind, group, timeout_s)
    res: dict = {"backend": obj.backend}
    try:
        res["good"] = _outcome(call)  # one round with everybody present
        dist.barrier(group=group)
        if me == absent and gone:  # (the last reference to the group goes: its connections close)
            obj.close()
            obj = call = None
            gc.collect()
            dist.destroy_process_group(group)
            group = None
        elif me == absent:
            time.sleep(timeout_s + 1.0)
            if kind != "output-ag_rs":  # (its reduce-scatter would wait for the group's timeout: nobody makes it)
                t0 = time.time()
                res["late"] = _outcome(call)
                res["late_dt"] = time.time() - t0
        else:
            t0 = time.time()
            try:
                call()
                res["first"] = "no error"
            except PeerTimeoutError as e:
                res["first"] = f"rank={e.rank} peer={e.peer} mech={e.mechanism}"
                res["message"] = str(e)
            except RuntimeError as e:
                res["first"] = f"{type(e).__name__}: {e}"
            res["dt"] = time.time() - t0
            if not gone:
                t0 = time.time()
                res["second"] = _outcome(call)
                res["second_dt"] = time.time() - t0
    finally:
        if obj is not None:
            obj.close()
        dist.barrier()  # (the pool's group: the object's one may hold a pending collective)
        if group is not None:
            dist.destroy_process_group(group)
    return res
