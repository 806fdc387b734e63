"""Functions run on every rank by tests/test_topk_host.py and tests/test_topk_gpu.py (module-level so spawn
can pickle them). Each returns plain Python data (bools, strings, lists), never tensors.

Every rank builds the same global data from the same seed, takes its own shard (the way a real DCP rank
would see it), and checks its result against the brute-force reference in ``peerdcp.topk.reference``.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import random
import time

import torch
import torch.distributed as dist

import peerdcp
from peerdcp.errors import PeerTimeoutError
from peerdcp.topk import reference as ref


def one_thread(fn):
    """Run with one intra-op thread: W interpreter processes on a 2-core machine otherwise oversubscribe
    (about 3x slower). The previous setting is restored for the pool's other users."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapper


# --------------------------------------------------------------------------------------------- data
TIE_VALUES = (-3.0, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, float("inf"), float("-inf"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tie_logits(T: int, L: int, seed: int, nan_frac: float = 0.05) -> torch.Tensor:
    """``[T, L]`` fp32 global scores with heavy ties (9 distinct values incl. +-0, +-inf) and NaNs."""
    g = _gen(seed)
    vals = torch.tensor(TIE_VALUES)
    x = vals[torch.randint(0, len(vals), (T, L), generator=g)]
    x[torch.rand(T, L, generator=g) < nan_frac] = float("nan")
    return x


def shard(global_logits: torch.Tensor, seq_lens: torch.Tensor, r: int, W: int, I: int, extra: int, seed: int):
    """Rank r's ``local_logits [T, L_local_max + extra]``: owned scores, then garbage (NaN/+inf/random)."""
    T, L = global_logits.shape
    Lloc = ref.local_length(L, 0, W, I) + extra
    g = _gen(seed + 7919 * (r + 1))
    local = torch.randn(T, Lloc, generator=g) * 100
    local[torch.rand(T, Lloc, generator=g) < 0.3] = float("inf")
    local[torch.rand(T, Lloc, generator=g) < 0.2] = float("nan")
    gid = ref.global_id(torch.arange(Lloc), r, W, I)
    for t in range(T):
        ok = gid < int(seq_lens[t])
        local[t, ok] = global_logits[t, gid[ok]]
    return local


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _device(device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


# --------------------------------------------------------------------------------------- exactness
@one_thread
def exactness(
    K: int, interleaves, lens_list, seed: int, memory: str = "host", device: str = "cpu", merge_impl: str = "auto"
) -> list[dict]:
    """For each interleave: direct and allgather selections (with and without forced tokens, twice) vs the
    reference. Returns per case: ok flags and digests (the parent compares them across ranks)."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(device)
    out = []
    for I in interleaves:
        lens = torch.tensor(lens_list, dtype=torch.int64)
        T = len(lens_list)
        max_rows = T if T > 1 else 1
        tks = {
            b: peerdcp.TopK(
                max_rows=max_rows, topk=K, backend=b, memory=memory, interleave=I, device=dev, merge_impl=merge_impl
            )
            for b in ("direct", "allgather")
        }
        try:
            assert tks["direct"].backend == "direct" and tks["allgather"].backend == "allgather"
            for case, (ff, fl) in enumerate(((0, 0), (3, 2))):
                s = seed + 1000 * case + I
                L = max(int(lens.max()), 1)
                glob_logits = tie_logits(T, L, s)
                local = shard(glob_logits, lens, r, W, I, extra=3, seed=s).to(dev)
                expect = ref.select_reference(glob_logits, lens, K, force_first=ff, force_last=fl)
                res = {"I": I, "K": K, "force": (ff, fl)}
                cand = tks["direct"].local_candidates(local, lens.to(dev), force_first=ff, force_last=fl).cpu()
                ecand = ref.candidates_reference(local.cpu(), lens, K, r, W, I, force_first=ff, force_last=fl)
                res["candidates"] = bool(torch.equal(cand, ecand))
                for b, tk in tks.items():
                    got = [tk.select(local, lens.to(dev), force_first=ff, force_last=fl) for _ in range(2)]
                    _sync(dev)
                    got = [x.cpu() for x in got]
                    res[b] = bool(torch.equal(got[0], expect)) and bool(torch.equal(got[1], expect))
                    res[b + "_digest"] = digest(got[0])
                    if not res[b]:
                        bad = (got[0] != expect).any(dim=1).nonzero().flatten().tolist()
                        res[b + "_bad_rows"] = bad
                        res[b + "_first_bad"] = (got[0][bad[0]].tolist(), expect[bad[0]].tolist())
                    rows, counts = tk.owned(got[0].to(dev))
                    erows, ecounts = ref.owned_reference(got[0], r, W, I)
                    same = torch.equal(rows.cpu(), erows) and torch.equal(counts.cpu(), ecounts)
                    res[b + "_owned"] = bool(same)
                    res[b + "_owned_rows"] = rows.cpu().tolist()
                res["expect_digest"] = digest(expect)
                out.append(res)
        finally:
            for tk in tks.values():
                tk.close()
    return out


@one_thread
def auto_fallback_rows(K: int, seed: int, memory: str = "host", device: str = "cpu") -> dict:
    """T > max_rows takes the allgather path; T <= max_rows the direct one; both exact."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(device)
    res = {}
    with peerdcp.TopK(max_rows=2, topk=K, memory=memory, device=dev) as tk:
        res["backend"] = tk.backend
        for T in (1, 2, 5, 2):
            lens = torch.tensor([3 * K + 5 * t for t in range(T)], dtype=torch.int64)
            gl = tie_logits(T, int(lens.max()), seed + T)
            local = shard(gl, lens, r, W, 1, 0, seed + T).to(dev)
            got = tk.select(local, lens.to(dev)).cpu()
            res[f"T{T}"] = bool(torch.equal(got, ref.select_reference(gl, lens, K)))
    return res


@one_thread
def back_to_back(
    n: int,
    K: int,
    I: int,
    max_rows: int,
    seed: int,
    memory: str = "host",
    device: str = "cpu",
    merge_impl: str = "auto",
    mix_paths: bool = False,
    merge_pdl: bool = False,
) -> dict:
    """``n`` selections with changing inputs and row counts, no barrier, random per-rank delays; every
    result is kept and checked only at the end (so ranks race through the parity slots). ``mix_paths``: each
    rank picks, per call and independently of the others, ``select()`` with the publish in the selection kernel
    (the GPU default), ``select()`` with the publish kernel (``select_publish`` off), or ``local_candidates()``
    then ``merge()``. ``merge_pdl``: ``select()``'s merge kernel launches with PDL (``select_merge_pdl``)."""
    from dataclasses import replace

    from peerdcp.topk.policy import DEFAULT_POLICY

    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(device)
    rng = random.Random(seed * 31 + r)  # per-rank delays: the ranks drift apart
    plan = random.Random(seed)  # shared plan: every rank makes the same calls
    results, expects = [], []
    policy = replace(DEFAULT_POLICY, select_merge_pdl=merge_pdl)
    kw = dict(max_rows=max_rows, topk=K, memory=memory, interleave=I, device=dev, merge_impl=merge_impl)
    # path 1: the same object's state and buffer, seen through an object whose policy has select_publish off
    with peerdcp.TopK(**kw, policy=policy) as tk:
        no_pub = tk._with_policy(replace(policy, select_publish=False))
        for i in range(n):
            T = plan.randint(1, max_rows + 1)  # max_rows + 1 -> the allgather path, mixed in
            lens = torch.tensor([plan.choice((0, 1, K - 1, K, 3 * K, 7 * K + 3)) for _ in range(T)])
            gl = tie_logits(T, max(int(lens.max()), 1), seed + i, nan_frac=0.1)
            local = shard(gl, lens, r, W, I, plan.randint(0, 2), seed + i).to(dev)
            path = rng.randrange(3) if mix_paths else 0
            if path == 0:
                results.append(tk.select(local, lens.to(dev)))
            elif path == 1:
                results.append(no_pub.select(local, lens.to(dev)))
            else:
                results.append(tk.merge(tk.local_candidates(local, lens.to(dev))))
            expects.append((gl, lens))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.02)
        _sync(dev)
        ok = [bool(torch.equal(g.cpu(), ref.select_reference(gl, ln, K))) for g, (gl, ln) in zip(results, expects)]
        digests = [digest(g) for g in results]
    return {"ok": ok, "digests": digests}


@one_thread
def bad_inputs(memory: str = "host", device: str = "cpu") -> dict:
    """Every bad call raises ValueError/TypeError before any kernel; a good call afterwards is still exact."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(device)
    K = 8
    names = []

    def expect_error(fn) -> None:
        try:
            fn()
            names.append("no error")
        except (ValueError, TypeError) as e:
            names.append(type(e).__name__)

    for kwargs in (
        {"max_rows": 0},
        {"max_rows": 4, "topk": 0},
        {"max_rows": 4, "topk": "8"},
        {"max_rows": 4, "backend": "nccl"},
        {"max_rows": 4, "memory": "gpu"},
        {"max_rows": 4, "interleave": 0},
        {"max_rows": 4, "timeout_s": 0},
        {"max_rows": 4, "timeout_s": float("inf")},
        {"max_rows": 4, "merge_impl": "fast"},
        *([{"max_rows": 4, "merge_impl": "cuda"}] if dev.type == "cpu" else []),  # no GPU: not available
    ):
        kw = {"memory": memory, "device": dev, **kwargs}
        expect_error(lambda kw=kw: peerdcp.TopK(**kw))
    # geometry that differs across ranks: ValueError on every rank
    expect_error(lambda: peerdcp.TopK(max_rows=4, topk=K + r, memory=memory, device=dev))
    # a bad argument on the last rank only: its own error there, a PeerSetupError naming it on the others (which
    # used to wait for it in the next all-gather until the group's timeout)
    try:
        peerdcp.TopK(max_rows=0 if r == W - 1 else 4, topk=K, memory=memory, device=dev).close()
        names.append("no error")
    except (ValueError, TypeError, peerdcp.PeerSetupError) as e:
        names.append(type(e).__name__ + (" names it" if f"rank {W - 1}" in str(e) else ""))

    lens = torch.tensor([5, 3 * K], device=dev)
    gl = tie_logits(2, 3 * K, 5)
    local = shard(gl, lens.cpu(), r, W, 1, 0, 5).to(dev)
    with peerdcp.TopK(max_rows=4, topk=K, memory=memory, device=dev) as tk:
        calls = [
            lambda: tk.select(local.half(), lens),
            lambda: tk.select(local[0], lens),
            lambda: tk.select(local.t().contiguous().t(), lens),
            lambda: tk.select(local, lens.float()),
            lambda: tk.select(local, lens[:1]),
            lambda: tk.select(local, lens, force_first=-1),
            lambda: tk.select(local, lens, force_last=1.5),
            lambda: tk.merge(torch.zeros(2, K, dtype=torch.int32, device=dev)),
            lambda: tk.merge(torch.zeros(2, K + 1, dtype=torch.int64, device=dev)),
            lambda: tk.owned(torch.zeros(2, K, dtype=torch.int64, device=dev)),
            lambda: tk.owned(torch.zeros(2, K - 1, dtype=torch.int32, device=dev)),
        ]
        if dev.type == "cpu":  # lengths are checked on the host only for CPU tensors
            calls.append(lambda: tk.select(local[:, :2], lens))
        for c in calls:
            expect_error(c)
        got = tk.select(local, lens)
        _sync(dev)
        good = bool(torch.equal(got.cpu(), ref.select_reference(gl, lens.cpu(), K)))
    closed = []
    try:
        tk.select(local, lens)
    except ValueError:
        closed.append("ValueError")
    return {"errors": names, "good_after": good, "closed": closed}


@one_thread
def bad_cache_inputs(device: str = "cpu") -> list[str]:
    """IndexKCache / indexer_logits argument checks (ValueError/TypeError before any kernel)."""
    dev = _device(device)
    names = []

    def expect_error(fn) -> None:
        try:
            fn()
            names.append("no error")
        except (ValueError, TypeError) as e:
            names.append(type(e).__name__)

    mk = peerdcp.IndexKCache
    for kw in (
        {"capacity_tokens": 0},
        {"capacity_tokens": 64, "head_dim": 48},
        {"capacity_tokens": 64, "page_size": 10},
        {"capacity_tokens": 64, "layout": "sharded"},
        {"capacity_tokens": 64, "interleave": 0},
        {"capacity_tokens": 64.0},
    ):
        expect_error(lambda kw=kw: mk(device=dev, **kw))
    r = dist.get_rank()
    expect_error(lambda: mk(capacity_tokens=64 * (r + 1), head_dim=32, page_size=16, device=dev))
    with mk(capacity_tokens=256, head_dim=32, page_size=16, device=dev) as c:
        k8, ks = random_keys(4, 32, 1)
        k8, ks = k8.to(dev), ks.to(dev)
        slots = torch.arange(4, device=dev)
        q = torch.zeros(2, 16, 32, device=dev).to(torch.float8_e4m3fn)
        w = torch.zeros(2, 16, device=dev)
        lens = torch.tensor([5, 9], device=dev)
        il = peerdcp.topk.indexer_logits
        for fn in (
            lambda: c.write(slots.float(), k8, ks),
            lambda: c.write(slots, k8.float(), ks),
            lambda: c.write(slots, k8[:3], ks),
            lambda: c.write(slots, k8, ks.double()),
            lambda: c.write(slots, k8, ks[:3]),
            lambda: il(q.float(), w, c, lens),
            lambda: il(torch.zeros(2, 16, 64, device=dev).to(torch.float8_e4m3fn), w, c, lens),
            lambda: il(q, w[:, :8], c, lens),
            lambda: il(q, w.double(), c, lens),
            lambda: il(q, w, c, lens[:1]),
            lambda: il(q, w, c, lens.float()),
            lambda: il(q, w, c, lens, max_seq_len=10_000),
            lambda: il(q, w, c, lens, block_table=torch.zeros(2, 3, dtype=torch.int64, device=dev)),
        ):
            expect_error(fn)
        out = il(q, w, c, lens, max_seq_len=9)
        names.append(f"ok {tuple(out.shape)}")
    expect_error(lambda: c.write(slots, k8, ks))
    return names


@one_thread
def missing_peer(absent: int, timeout_s: float, memory: str = "host", device: str = "cpu") -> str:
    """Rank ``absent`` never calls select: the others raise PeerTimeoutError within the timeout, then refuse."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(device)
    K = 8
    tk = peerdcp.TopK(max_rows=2, topk=K, memory=memory, timeout_s=timeout_s, device=dev)
    lens = torch.tensor([4 * K], device=dev)
    gl = tie_logits(1, 4 * K, 3)
    local = shard(gl, lens.cpu(), r, W, 1, 0, 3).to(dev)
    try:
        if r == absent:
            time.sleep(timeout_s * 2.5)
            return "absent"
        t0 = time.time()
        msgs = []
        try:
            tk.select(local, lens)
            tk.check()
            msgs.append("no error")
        except PeerTimeoutError as e:
            msgs.append(f"timeout rank={e.rank} peer={e.peer} mech={e.mechanism} dt={time.time() - t0:.2f}")
        for fn in (lambda: tk.select(local, lens), tk.check):
            try:
                fn()
                msgs.append("no error")
            except PeerTimeoutError:
                msgs.append("refused")
        return " | ".join(msgs)
    finally:
        dist.barrier()
        tk.close()
        tk.close()


def resources() -> dict:
    pid = os.getpid()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/peerdcp-" in line)
    return {"fds": fds, "maps": maps, "shm": len(glob.glob("/dev/shm/peerdcp-*"))}


@one_thread
def create_close_cycles(n: int) -> dict:
    before = resources()
    for i in range(n):
        tk = peerdcp.TopK(max_rows=2, topk=8, memory="host", device="cpu")
        if i % 5 == 0:
            lens = torch.tensor([20])
            tk.select(torch.zeros(1, 20), lens)
        tk.close()
        with peerdcp.IndexKCache(capacity_tokens=256, head_dim=32, page_size=16, device="cpu") as c:
            c.check()
    return {"before": before, "after": resources()}


# ------------------------------------------------------------------------------------- index cache
def random_keys(N: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    k = torch.randn(N, D, generator=g) * torch.exp(torch.randn(N, 1, generator=g) * 3)
    return ref.quantize_k(k)


@one_thread
def cache_roundtrip(I: int, layout: str, D: int = 32, P: int = 16, device: str = "cpu") -> dict:
    """Write three sequences by logical slot from every rank; read every slot back."""
    dev = _device(device)
    cache = peerdcp.IndexKCache(capacity_tokens=5000, head_dim=D, page_size=P, layout=layout, interleave=I, device=dev)
    A = cache.seq_align
    lens = [37, 3 * A + 5, 1]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + A * -(-n // A))  # each sequence starts on an aligned slot
    slots = torch.cat([s + torch.arange(n) for s, n in zip(starts, lens)])
    k8, ks = random_keys(slots.numel(), D, 11)
    perm = torch.randperm(slots.numel(), generator=_gen(3))  # write order does not matter
    cache.write(slots[perm].to(dev), k8[perm].to(dev), ks[perm].to(dev))
    cache.write(torch.tensor([-1, cache.capacity_tokens], device=dev), k8[:2].to(dev), ks[:2].to(dev))  # skipped
    got8, gots, own = cache.read(slots.to(dev))
    own = own.cpu()
    same8 = torch.equal(got8.cpu()[own].view(torch.uint8), k8[own].view(torch.uint8))
    sames = torch.equal(gots.cpu()[own], ks[own])
    nonzero_scales = int((cache.storage[:, P * D :].contiguous().view(torch.float32) != 0).sum())
    rep = cache.capacity_report()
    cache.close()
    cache.close()
    return {
        "owned": own.tolist(),
        "data": same8,
        "scales": sames,
        "stored": nonzero_scales,
        "report": rep,
        "page_bytes": cache.page_bytes,
    }


@one_thread
def scoring(
    H: int,
    D: int,
    P: int,
    I: int,
    seed: int,
    device: str = "cpu",
    upcast: bool = False,
    npage: int = 0,
    tuning: dict | None = None,
    lens_dtype: torch.dtype = torch.int64,
) -> dict:
    """See :func:`_scoring`; ``upcast`` forces the fp16 fallback path (``TopKPolicy.scan_upcast``), ``npage``
    the GPU kernel's pages per program (``scan_npage``; 0 = the policy's rule), ``tuning`` more ``TopKPolicy``
    fields, ``lens_dtype`` the dtype of every ``seq_lens`` passed (int32 or int64).
    ``cuda_calls``: launches of the CUDA scan (``ops.score``) the case made."""
    from dataclasses import replace
    from unittest import mock

    from peerdcp.topk import ops
    from peerdcp.topk.policy import DEFAULT_POLICY

    policy = replace(DEFAULT_POLICY, scan_upcast=upcast, scan_npage=npage, **(tuning or {}))
    with mock.patch.object(ops, "score", wraps=ops.score) as spy:
        res = _scoring(H, D, P, I, seed, device, lens_dtype, policy)
        res["cuda_calls"] = spy.call_count
        return res


def _scoring(
    H: int, D: int, P: int, I: int, seed: int, device: str, lens_dtype: torch.dtype = torch.int64, policy=None
) -> dict:
    """indexer_logits against the fp64 reference, owner-sharded and replicated, with MTP rows and a block
    table over two sequences; sharded scores must equal the replicated kernel's bit for bit.

    Error bound: ``rtol * sum_h |w| sum_d |q k| * scale``. rtol is 1e-5 for the interpreter (fp32 numpy
    dot) and 2^-10 on GPU, where Hopper's FP8 tensor cores keep about 14 mantissa bits while they accumulate
    (DeepSeek-V3 report, section 3.3.2) and round at each of the accumulation steps of a 128-term dot (four k = 32
    MMAs, each summing its products in parts). Measured worst (both GPU kernels on the same data):
    6.7e-4 = 2^-10.5 with 1 to 4 heads, where nothing averages the heads' errors; 8.6e-5 with 64 heads. A wrong
    token, page, head or scale is off by O(1)."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device(device)
    g = _gen(seed)
    caches = {
        lay: peerdcp.IndexKCache(capacity_tokens=4096, head_dim=D, page_size=P, layout=lay, interleave=I, device=dev)
        for lay in ("owner_sharded", "replicated")
    }
    A = max(c.seq_align for c in caches.values())
    S = [300, 129]  # two sequences
    starts = [0, A * ((S[0] + A - 1) // A)]
    kk, ksc = random_keys(sum(S), D, seed)
    k_of = [kk[: S[0]], kk[S[0] :]]
    s_of = [ksc[: S[0]], ksc[S[0] :]]
    slots = torch.cat([st + torch.arange(n) for st, n in zip(starts, S)])
    for c in caches.values():
        c.write(slots.to(dev), kk.to(dev), ksc.to(dev))
    # rows: seq 0 with three MTP rows (lengths 298, 299, 300), seq 1 with lengths 129 and 1, seq 0 with 0
    row_seq = [0, 0, 0, 1, 1, 0]
    row_len = torch.tensor([298, 299, 300, 129, 1, 0])
    T = len(row_seq)
    q = (torch.randn(T, H, D, generator=g) * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.randn(T, H, generator=g) * 0.05
    res = {}
    outs = {}
    for lay, c in caches.items():
        npg = -(-ref.local_length(max(S), 0, W, I) // P) if c.sharded else -(-max(S) // P)
        table = c.block_table(torch.tensor([starts[s] for s in row_seq], device=dev), npg)
        out = peerdcp.topk.indexer_logits(
            q.to(dev), w.to(dev), c, row_len.to(dev, lens_dtype), block_table=table, max_seq_len=max(S), policy=policy
        ).cpu()
        outs[lay] = out
        ok_vals, ok_mask, worst = True, True, 0.0
        for t in range(T):
            L = int(row_len[t])
            nloc = ref.local_length(L, r, W, I) if c.sharded else L
            gid = ref.global_id(torch.arange(nloc), r, W, I) if c.sharded else torch.arange(nloc)
            s = row_seq[t]
            exp = ref.index_scores(q[t : t + 1], w[t : t + 1], k_of[s][gid], s_of[s][gid])[0]
            mag = ref.index_scores_abs(q[t : t + 1], w[t : t + 1], k_of[s][gid], s_of[s][gid])[0]
            err = (out[t, :nloc].double() - exp.double()).abs()
            tol = (2.0**-10 if dev.type == "cuda" else 1e-5) * mag + 1e-30
            if nloc:
                worst = max(worst, float((err / (mag + 1e-30)).max()))
            ok_vals &= bool((err <= tol).all())
            ok_mask &= bool(torch.isneginf(out[t, nloc:]).all())
        res[lay] = {"values": ok_vals, "mask": ok_mask, "worst_rel": worst, "shape": list(out.shape)}
    # owner-sharded row l is global token global_id(l): compare with the replicated kernel bit for bit
    sh, rp = outs["owner_sharded"], outs["replicated"]
    bit = True
    for t in range(T):
        nloc = ref.local_length(int(row_len[t]), r, W, I)
        gid = ref.global_id(torch.arange(nloc), r, W, I)
        bit &= torch.equal(sh[t, :nloc].view(torch.int32), rp[t, gid].view(torch.int32))
    res["bitwise_vs_replicated"] = bool(bit)
    # a block table narrower than the rows: local rows past its 2 pages score -inf, the ones before are as
    # with the full table (the kernel never reads a table entry past the row's columns)
    c = caches["replicated"]
    narrow = c.block_table(torch.tensor([starts[s] for s in row_seq], device=dev), 2)
    o3 = peerdcp.topk.indexer_logits(
        q.to(dev), w.to(dev), c, row_len.to(dev, lens_dtype), block_table=narrow, max_seq_len=max(S), policy=policy
    ).cpu()
    cut = 2 * P
    res["narrow_table"] = (
        o3.shape == rp.shape
        and torch.equal(o3[:, :cut].view(torch.int32), rp[:, :cut].view(torch.int32))
        and bool(torch.isneginf(o3[:, cut:]).all())
    )
    # default addressing (no block table, one sequence at slot 0, max_seq_len from seq_lens)
    c = caches["owner_sharded"]
    lens0 = torch.tensor([300, 298])
    o2 = peerdcp.topk.indexer_logits(
        q[[2, 0]].to(dev), w[[2, 0]].to(dev), c, lens0.to(dev, lens_dtype), policy=policy
    ).cpu()
    n2 = o2.shape[1]
    res["no_table"] = o2.shape[1] == ref.local_length(300, 0, W, I) and bool(
        torch.equal(o2.view(torch.int32), sh[[2, 0], :n2].view(torch.int32))
    )
    for c in caches.values():
        c.close()
    return res


@one_thread
def pipeline(H: int, D: int, K: int, I: int, seed: int, memory: str = "host", device: str = "cpu") -> dict:
    """quantize -> write (owner-sharded and replicated) -> score -> select: the sharded pipeline selects
    exactly what the replicated scan + canonical top-k selects, on every rank."""
    dev = _device(device)
    g = _gen(seed)
    L = 700
    kk, ksc = random_keys(L, D, seed)
    T = 3
    lens = torch.tensor([L, L - 1, 40])
    q = (torch.randn(T, H, D, generator=g) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(T, H, generator=g) * 0.05
    with (
        peerdcp.IndexKCache(capacity_tokens=1024, head_dim=D, interleave=I, device=dev) as sh,
        peerdcp.IndexKCache(capacity_tokens=1024, head_dim=D, layout="replicated", device=dev) as rp,
        peerdcp.TopK(max_rows=4, topk=K, memory=memory, interleave=I, device=dev) as tk,
    ):
        for c in (sh, rp):
            c.write(torch.arange(L, device=dev), kk.to(dev), ksc.to(dev))
        args = (q.to(dev), w.to(dev))
        loc = peerdcp.topk.indexer_logits(*args, sh, lens.to(dev), max_seq_len=L)
        full = peerdcp.topk.indexer_logits(*args, rp, lens.to(dev), max_seq_len=L)
        ids = tk.select(loc, lens.to(dev), force_first=1, force_last=4)
        base = peerdcp.topk.canonical_topk(full, lens.to(dev), K, force_first=1, force_last=4)
        _sync(dev)
        exp = ref.select_reference(full.cpu(), lens, K, force_first=1, force_last=4)
        report = sh.capacity_report()
        return {
            "equal_baseline": bool(torch.equal(ids.cpu(), base.cpu())),
            "equal_reference": bool(torch.equal(ids.cpu(), exp)),
            "digest": digest(ids),
            "fraction": report["fraction_of_replicated"],
            "bytes": (sh.nbytes, rp.nbytes),
        }


# ---------------------------------------------------------------------------------------- GPU only
def graph_exactness(
    K: int, I: int, memory: str, backend: str, replays: int, seed: int, merge_impl: str = "auto"
) -> dict:
    """CUDA graph: capture three selects (two direct-sized, one beyond max_rows when backend allows), then
    replay with fresh inputs copied into the static buffers; every replay exact and identical across ranks."""
    W, r = dist.get_world_size(), dist.get_rank()
    dev = _device("cuda")
    T, Lg = 4, 6 * K + 11
    lens_choices = (0, 1, K - 1, K, 3 * K, Lg)
    with peerdcp.TopK(
        max_rows=T, topk=K, memory=memory, backend=backend, interleave=I, device=dev, merge_impl=merge_impl
    ) as tk:
        Lloc = ref.local_length(Lg, 0, W, I) + 2
        logit_bufs = [torch.zeros(T, Lloc, device=dev) for _ in range(2)]
        len_bufs = [torch.zeros(T, dtype=torch.int64, device=dev) for _ in range(2)]
        plan = random.Random(seed)

        def fill(i: int, it: int):
            lens = torch.tensor([plan.choice(lens_choices) for _ in range(T)])
            gl = tie_logits(T, Lg, seed + 100 * it + i)
            logit_bufs[i].copy_(shard(gl, lens, r, W, I, 2, seed + it).to(dev))
            len_bufs[i].copy_(lens.to(dev))
            return gl, lens

        for i in range(2):
            fill(i, 0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(2):
                tk.select(logit_bufs[i], len_bufs[i])  # warm-up (compiles) outside the graph
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [tk.select(logit_bufs[i], len_bufs[i], force_first=i) for i in range(2)]
        ok, digests = [], []
        for it in range(1, replays + 1):
            cases = [fill(i, it) for i in range(2)]
            graph.replay()
            eager = tk.select(logit_bufs[0], len_bufs[0])  # eager calls between replays share the epochs
            torch.cuda.synchronize()
            for i, (gl, lens) in enumerate(cases):
                ok.append(bool(torch.equal(outs[i].cpu(), ref.select_reference(gl, lens, K, force_first=i))))
            ok.append(bool(torch.equal(eager.cpu(), ref.select_reference(cases[0][0], cases[0][1], K))))
            digests.append(digest(outs[0]) + digest(outs[1]))
        tk.check()
        return {"ok": ok, "digests": digests, "backend": tk.backend, "memory": tk.memory, "merge_impl": tk.merge_impl}


def scoring_pdl(seed: int, calls: int = 6, backend: str = "triton") -> dict:
    """The scoring kernel launched with programmatic dependent launch (``TopKPolicy.scan_pdl`` 1 and 2) against
    the same kernel without it, bit for bit: eager, and in one CUDA graph where the calls run back to back (each
    PDL call may start while the previous one drains) with a cache write between two of them (the later calls
    must see the token it adds). Outputs are poisoned (NaN) before each replay. ``backend`` is
    ``TopKPolicy.scan_backend``: with "cuda" (no PDL option) the same checks hold the CUDA scan's graph replays
    to its eager calls."""
    from dataclasses import replace
    from unittest import mock

    from peerdcp.topk import ops
    from peerdcp.topk.policy import DEFAULT_POLICY

    dev = _device("cuda")
    W, r = dist.get_world_size(), dist.get_rank()
    c = peerdcp.IndexKCache(capacity_tokens=1 << 15, layout="owner_sharded", device=dev)
    S = 20000  # tokens already cached; one more is written in the middle of the chain
    kk, ksc = random_keys(S + 1, 128, seed)
    c.write(torch.arange(S, device=dev), kk[:S].to(dev), ksc[:S].to(dev))
    T, H = 8, 64
    g = _gen(seed + 1)
    qs = [(torch.randn(T, H, 128, generator=g) * 2).to(torch.float8_e4m3fn).to(dev) for _ in range(calls)]
    w = (torch.randn(T, H, generator=g) * 0.02).to(dev)
    npg = -(-ref.local_length(S + 1, 0, W, 1) // c.page_size)
    table = c.block_table(torch.zeros(T, dtype=torch.int64, device=dev), npg)
    lens = torch.full((T,), S + 1, dtype=torch.int64, device=dev)
    mid = calls // 2
    new_slot, new_k, new_s = torch.tensor([S], device=dev), kk[S:].to(dev), ksc[S:].to(dev)

    def chain(pdl: int) -> list[torch.Tensor]:
        policy = replace(DEFAULT_POLICY, scan_pdl=pdl, scan_backend=backend)
        outs = []
        for i in range(calls):
            if i == mid:  # the new token lands between two scoring calls
                c.write(new_slot, new_k, new_s)
            il = peerdcp.topk.indexer_logits
            outs.append(il(qs[i], w, c, lens, block_table=table, max_seq_len=S + 1, policy=policy))
        return outs

    def reset() -> None:  # the token at S back to "not written yet" (zero key, zero scale)
        c.storage.view(-1)[:] = snapshot

    snapshot = c.storage.view(-1).clone()
    res = {}
    with mock.patch.object(ops, "score", wraps=ops.score) as spy:
        want = [o.clone() for o in chain(0)]
    res["cuda_launches"] = spy.call_count  # the kernel the chain really ran: CUDA scan launches of the eager chain
    torch.cuda.synchronize()
    # the new token (rank owning slot S) scores nonzero in the calls after the write, zero before
    own = ref.owner(torch.tensor(S), W, 1).item() == r
    row = ref.local_row(torch.tensor(S), W, 1).item()
    res["new_token_seen"] = (not own) or bool((want[mid][:, row] != 0).any() and (want[mid - 1][:, row] == 0).all())
    for mode in (1, 2):
        reset()
        got = chain(mode)
        torch.cuda.synchronize()
        res[f"eager{mode}"] = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want, got))
        reset()
        chain(mode)  # compile / warm outside the capture
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(mode)
        ok = True
        for _ in range(3):
            reset()
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ok &= all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(want, outs))
        res[f"graph{mode}"] = ok
        del graph, outs
    c.close()
    return res


def scoring_register_cap(seed: int) -> dict:
    """The scoring kernel with ``TopKPolicy.scan_maxnreg`` at 64 (the library's) against the uncapped kernel, bit for
    bit, for head counts whose tile is 64 (capped: 32, 64) and wider (not capped: 128, 200), at row counts and
    lengths that take the one-page, small, wave-fill and large pages-per-program rules. Each output is poisoned (NaN)
    once copied, so a block the allocator hands to the next call holds no earlier scores. Returns ``{H: [per case:
    bit-equal and some score finite]}`` (the fp64 reference checks are the pages-per-program tests')."""
    from dataclasses import replace

    from peerdcp.topk.policy import DEFAULT_POLICY

    dev = _device("cuda")
    W = dist.get_world_size()
    c = peerdcp.IndexKCache(capacity_tokens=1 << 17, layout="owner_sharded", device=dev)
    S = 1 << 17
    kk, ksc = random_keys(S, 128, seed)
    c.write(torch.arange(S, device=dev), kk.to(dev), ksc.to(dev))
    g = _gen(seed + 1)
    res = {}
    for H in (32, 64, 128, 200):
        ok = []
        for T, L in ((1, 4000), (8, 40000), (32, 30000), (64, S)):
            q = (torch.randn(T, H, 128, generator=g) * 2).to(torch.float8_e4m3fn).to(dev)
            w = (torch.randn(T, H, generator=g) * 0.02).to(dev)
            lens = torch.randint(1, L + 1, (T,), generator=g).to(dev)
            lens[0] = L
            npg = -(-ref.local_length(L, 0, W, 1) // c.page_size)
            table = c.block_table(torch.zeros(T, dtype=torch.int64, device=dev), npg)
            outs = []
            for cap in (64, 0):
                policy = replace(DEFAULT_POLICY, scan_maxnreg=cap, scan_backend="triton")
                o = peerdcp.topk.indexer_logits(q, w, c, lens, block_table=table, max_seq_len=L, policy=policy)
                outs.append(o.view(torch.int32).clone())
                o.fill_(float("nan"))  # the allocator may hand this block to the next call: poison it
            ok.append(bool(torch.equal(outs[0], outs[1])) and bool(torch.isfinite(outs[0].view(torch.float32)).any()))
        res[H] = ok
    c.close()
    return res


def scoring_refused_cap(seed: int) -> dict:
    """A register cap ptxas refuses (32: the FP8 MMA needs ~58) must fall back to the uncapped FP8 kernel - same
    bits as ``scan_maxnreg`` = 0, one warning, the FP8 path kept (not the fp16 one) - with the module's compile
    memos empty as on a first call."""
    import warnings
    from dataclasses import replace
    from unittest import mock

    from peerdcp.topk import scorer as scorer_mod
    from peerdcp.topk.policy import DEFAULT_POLICY

    dev = _device("cuda")
    W = dist.get_world_size()
    c = peerdcp.IndexKCache(capacity_tokens=1 << 14, layout="owner_sharded", device=dev)
    S = 10000
    kk, ksc = random_keys(S, 128, seed)
    c.write(torch.arange(S, device=dev), kk.to(dev), ksc.to(dev))
    g = _gen(seed + 1)
    T, H = 4, 64
    q = (torch.randn(T, H, 128, generator=g) * 2).to(torch.float8_e4m3fn).to(dev)
    w = (torch.randn(T, H, generator=g) * 0.02).to(dev)
    lens = torch.tensor([S, S - 1, 100, 0], device=dev)
    npg = -(-ref.local_length(S, 0, W, 1) // c.page_size)
    table = c.block_table(torch.zeros(T, dtype=torch.int64, device=dev), npg)

    def score(cap: int) -> torch.Tensor:
        policy = replace(DEFAULT_POLICY, scan_maxnreg=cap, scan_backend="triton")
        out = peerdcp.topk.indexer_logits(q, w, c, lens, block_table=table, max_seq_len=S, policy=policy)
        return out.view(torch.int32).clone()

    want = score(0)
    key = (dev.index, 64)
    with (
        mock.patch.object(scorer_mod, "_UPCAST", {}),
        mock.patch.object(scorer_mod, "_UNCAPPED", set()),
    ):
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            got1 = score(32)
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            got2 = score(32)
        ours = [[str(x.message) for x in ws if "indexer_logits" in str(x.message)] for ws in (first, second)]
        res = {
            "same_bits": bool(torch.equal(got1, want)) and bool(torch.equal(got2, want)),
            "warned_once": len(ours[0]) == 1 and "register cap refused" in ours[0][0] and not ours[1],
            "fp8_kept": scorer_mod._UPCAST.get(key) is False,
            "uncapped_noted": key in scorer_mod._UNCAPPED,
        }
    c.close()
    return res


@one_thread
def audit_inputs(device: str = "cpu") -> dict:
    """Inputs that the checks must refuse, each of which otherwise gives wrong results (a seq_lens column view
    read as contiguous; block-table starts off the alignment) or fails late (a 0-d k_scale, cache=None, a huge
    max_seq_len with a block table, force_first = 2^63). Each must raise ValueError / TypeError."""
    dev = _device(device)
    K = 8
    out = {}

    def expect_error(name, fn) -> None:
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    lens2d = torch.tensor([[3, 99], [20, 99]], device=dev)
    logits = torch.randn(2, 64, device=dev)
    expect_error("canonical_topk column lens", lambda: peerdcp.topk.canonical_topk(logits, lens2d[:, 0], K))
    expect_error("canonical_topk force 2^63", lambda: peerdcp.topk.canonical_topk(logits, lens2d[:, 0].contiguous(),
                                                                                  K, force_first=2**63))  # fmt: skip
    with peerdcp.TopK(max_rows=4, topk=K, memory="host" if dev.type == "cpu" else "vmm", device=dev) as tk:
        expect_error("select column lens", lambda: tk.select(logits, lens2d[:, 0]))
    with peerdcp.IndexKCache(capacity_tokens=256, head_dim=32, page_size=16, device=dev) as c:
        q = torch.zeros(2, 16, 32, device=dev).to(torch.float8_e4m3fn)
        w = torch.zeros(2, 16, device=dev)
        il = peerdcp.topk.indexer_logits
        expect_error("indexer_logits column lens", lambda: il(q, w, c, lens2d[:, 0], max_seq_len=20))
        expect_error("indexer_logits cache None", lambda: il(q, w, None, lens2d[:, 0].contiguous()))
        bt = c.block_table(torch.tensor([0, c.seq_align]), 2).to(dev)
        expect_error("indexer_logits max_seq_len 2^40", lambda: il(q, w, c, lens2d[:, 0].contiguous(), block_table=bt,
                                                                   max_seq_len=2**40))  # fmt: skip
        expect_error("block_table start off alignment", lambda: c.block_table(torch.tensor([c.seq_align // 2]), 2))
        expect_error("block_table num_pages 2.5", lambda: c.block_table(torch.tensor([0]), 2.5))
        expect_error("block_table float starts", lambda: c.block_table(torch.tensor([0.0]), 2))
        k8, _ = random_keys(1, 32, 1)
        expect_error("write 0-d k_scale", lambda: c.write(torch.tensor([0], device=dev), k8.to(dev),
                                                          torch.tensor(1.0, device=dev)))  # fmt: skip
        out["aligned table"] = str(bt.tolist())
    return out
