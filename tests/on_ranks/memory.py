"""Functions run on every rank by tests/test_memory_host.py (module-level so spawn can pickle them)."""

from __future__ import annotations

import gc
import glob
import os

import torch

import peerdcp
from peerdcp.errors import PeerSetupError, PeerTimeoutError
from peerdcp.memory.buffer import PEER_ALIGN
from peerdcp.memory.selftest import expected_pattern, roundtrip, roundtrip_nbytes


def write_read_all(nbytes: int, memory: str = "host", device: str = "cpu") -> dict:
    import torch.distributed as dist

    buf = peerdcp.memory.allocate(nbytes, memory=memory, device=device)
    W, r = buf.world_size, buf.rank
    n = nbytes // (4 * W)
    try:
        assert buf.memory == memory and buf.nbytes == nbytes and buf.local.numel() == nbytes
        assert buf.peer_ptrs.dtype == torch.int64 and buf.peer_ptrs.shape == (W,)
        assert buf.peer_ptrs.tolist() == buf.peer_addrs and all(a % PEER_ALIGN == 0 for a in buf.peer_addrs)
        zero_ok = bool((buf.local == 0).all())
        dist.barrier()  # peers may only write once everyone has looked at its fresh buffer
        # every rank writes a distinct pattern into its slot of every peer
        for p in range(W):
            v = buf.view(p, (W, n), torch.int32)
            v[r] = torch.arange(n, dtype=torch.int32, device=buf.device) * 7 + r * 100003 + p * 17
        if buf.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        mine = buf.view(r, (W, n), torch.int32)
        ok = all(
            torch.equal(mine[s], torch.arange(n, dtype=torch.int32, device=buf.device) * 7 + s * 100003 + r * 17)
            for s in range(W)
        )
        # and reads every peer's slot written by every rank
        reads = all(
            torch.equal(
                buf.view(p, (W, n), torch.int32)[s],
                torch.arange(n, dtype=torch.int32, device=buf.device) * 7 + s * 100003 + p * 17,
            )
            for p in range(W)
            for s in range(W)
        )
        dist.barrier()
    finally:
        buf.close()
    buf.close()  # idempotent
    return {"zero": zero_ok, "ok": ok, "reads": reads, "closed": buf.closed}


def fill_collective(nbytes: int, offset: int, n: int, value: int) -> dict:
    """Each rank fills bytes [offset, offset + n) of its buffer with `value` collectively; right after the
    call, every rank reads every peer's range (already landed) and the bytes around it (untouched, zero)."""
    buf = peerdcp.memory.allocate(nbytes, memory="host", device="cpu")
    try:
        buf.fill_collective(offset, n, value)
        peers = [buf.view(p, (nbytes,), torch.uint8) for p in range(buf.world_size)]
        filled = all(bool((v[offset : offset + n] == value).all()) for v in peers)
        rest = all(int(v[:offset].sum()) + int(v[offset + n :].sum()) == 0 for v in peers)
        errors = []
        for bad in ((-1, n, value), (offset, nbytes, value), (offset, n, 256)):
            try:
                buf.fill_collective(*bad)
            except ValueError as e:
                errors.append(str(e))
    finally:
        buf.close()
    return {"filled": filled, "rest": rest, "errors": errors}


def kernel_roundtrip(rounds: int, n: int, memory: str = "host", device: str = "cpu") -> list[bool]:
    W = torch.distributed.get_world_size()
    res = []
    with peerdcp.memory.allocate(roundtrip_nbytes(W, n), memory=memory, device=device) as buf:
        for e in range(1, rounds + 1):
            out = roundtrip(buf, e, n, timeout_s=30.0).cpu()
            res.append(all(torch.equal(out[s], expected_pattern(s, buf.rank, e, n)) for s in range(W)))
    return res


def roundtrip_missing_peer(absent: int, timeout_s: float) -> str:
    import time

    W = torch.distributed.get_world_size()
    with peerdcp.memory.allocate(roundtrip_nbytes(W, 4), memory="host", device="cpu") as buf:
        if buf.rank == absent:
            time.sleep(timeout_s * 1.5)
            return "absent"
        t0 = time.time()
        try:
            roundtrip(buf, 1, 4, timeout_s=timeout_s)
        except PeerTimeoutError as e:
            return f"timeout rank={e.rank} peer={e.peer} mech={e.mechanism} dt={time.time() - t0:.2f}"
        return "no error"


def resources() -> dict:
    # An earlier test on this pooled process may leave reference cycles holding fds (an exception's traceback
    # keeps its frames' files open); collect them now so they are not counted here and closed mid-measurement.
    gc.collect()
    pid = os.getpid()
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/peerdcp-" in line)
    return {"fds": fds, "maps": maps, "shm": len(glob.glob("/dev/shm/peerdcp-*"))}


def cycle(n: int, nbytes: int) -> dict:
    before = resources()
    for _ in range(n):
        buf = peerdcp.memory.allocate(nbytes, memory="host", device="cpu")
        buf.view(buf.rank, (4,), torch.int32).fill_(buf.rank)
        buf.close()
    after = resources()
    return {"before": before, "after": after}


def faulty_allocate(fault_rank: int, stage: str) -> dict:
    before = resources()
    try:
        peerdcp.memory.allocate(1 << 16, memory="host", device="cpu", _fault=(fault_rank, stage))
        outcome = "allocated"
    except PeerSetupError as e:
        outcome = f"PeerSetupError: {e}"
    after = resources()
    return {"outcome": outcome, "before": before, "after": after}


def bad_args() -> list[str]:
    msgs = []
    for kwargs in (
        {"nbytes": 0},
        {"nbytes": -5},
        {"nbytes": 1.5},
        {"nbytes": 64, "memory": "nvshmem"},
        {"nbytes": 64, "memory": "vmm", "device": "cpu"},
    ):
        nb = kwargs.pop("nbytes")
        try:
            peerdcp.memory.allocate(nb, **kwargs)
            msgs.append("no error")
        except (ValueError, TypeError) as e:
            msgs.append(type(e).__name__)
    return msgs


def probe_json() -> dict:
    return peerdcp.probe().to_dict()


def gpu_cycles(memory: str, n: int, nbytes: int) -> dict:
    """n allocate/close cycles on the GPU; device memory and fds must not grow after the first."""
    torch.cuda.synchronize()
    # The first cycle may create pools, and its fill_ loads the fill kernel's module (CUDA lazy loading
    # takes ~2 MiB per module on first launch): the same work as a measured cycle, outside the measurement.
    buf = peerdcp.memory.allocate(nbytes, memory=memory)
    buf.view(buf.rank, (4,), torch.int32).fill_(-1)
    buf.close()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    reserved0 = torch.cuda.memory_reserved()
    fds0 = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    drops, last = [], free0  # (cycle, bytes) where free device memory fell: where any growth happened
    for i in range(n):
        buf = peerdcp.memory.allocate(nbytes, memory=memory)
        buf.view(buf.rank, (4,), torch.int32).fill_(i)
        buf.close()
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        if free < last:
            drops.append((i, last - free, torch.cuda.memory_reserved() - reserved0))
        last = free
    free1 = torch.cuda.mem_get_info()[0]
    fds1 = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    return {
        "free_drop": free0 - free1,
        "fds": (fds0, fds1),
        "drops": drops,  # (cycle, bytes, torch caching-allocator reserved growth by then)
        "reserved_growth": torch.cuda.memory_reserved() - reserved0,
    }


def one_rank_bad_args(bad_rank: int) -> list[str]:
    """Every rank calls allocate(); rank ``bad_rank`` with a bad argument. The outcome per case, by type and a
    prefix of the message (a rank that waited for the bad one until the group's timeout would never return)."""
    out = []
    for bad in ({"nbytes": 0}, {"nbytes": 1.5}, {"nbytes": 64, "memory": "nvshmem"}):
        kwargs = dict(bad) if torch.distributed.get_rank() == bad_rank else {"nbytes": 4096}
        nb = kwargs.pop("nbytes")
        try:
            peerdcp.memory.allocate(nb, memory=kwargs.pop("memory", "host"), device="cpu").close()
            out.append("allocated")
        except (ValueError, TypeError, PeerSetupError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def close_after_peer_died(rank: int, world: int, init_file: str, q) -> None:
    """Spawned (not a RankPool rank: one of them dies). Rank 1 exits after the allocation; rank 0's close() must
    raise PeerSetupError and still unmap everything."""
    import datetime

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    buf = peerdcp.memory.allocate(1 << 16, memory="host", device="cpu")
    mapped = resources()["maps"]
    torch.distributed.barrier()
    if rank == 1:
        os._exit(0)  # dies without close()
    import time

    time.sleep(1.0)
    try:
        buf.close()
        outcome = "closed"
    except PeerSetupError as e:
        outcome = f"PeerSetupError: {e}"
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        outcome = f"{type(e).__name__}: {e}"
    q.put({"mapped": mapped, "outcome": outcome, "closed": buf.closed, "after": resources()["maps"]})
    q.close()
    q.join_thread()
    os._exit(0)


def allocate_without_space(full_rank: int) -> str:
    import errno
    from unittest import mock

    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    patch = mock.patch("os.posix_fallocate", no_space) if torch.distributed.get_rank() == full_rank else None
    try:
        if patch is not None:
            patch.start()
        peerdcp.memory.allocate(1 << 20, memory="host", device="cpu").close()
        return "allocated"
    except PeerSetupError as e:
        return f"PeerSetupError: {e}"
    finally:
        if patch is not None:
            patch.stop()


_TWIN_BACKEND = "peerdcp_twin_test"


def _twin_backend() -> str:
    """A CPU backend that is gloo under another name: peerdcp does not take it for gloo, so groups of it get a
    gloo twin from ``_dist.resolve_group``, as NCCL groups do (which CPU machines cannot create)."""
    import torch.distributed as dist

    if _TWIN_BACKEND not in dist.Backend.backend_list:

        def create(store, rank, size, timeout):
            return dist.ProcessGroupGloo(store, rank, size, timeout=timeout)

        dist.Backend.register_backend(_TWIN_BACKEND, create, devices=["cpu"])
    return _TWIN_BACKEND


def _counts() -> dict:
    import threading

    from torch.distributed import distributed_c10d as c10d

    pid = os.getpid()
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": threading.active_count() + len(os.listdir(f"/proc/{pid}/task")),
        "groups": len(c10d._world.pg_map),
    }


def twin_cycles(n: int) -> dict:
    """``n`` times: a group of the twin-needing backend, a host buffer on it, close, destroy the group. Then two live
    groups of the same ranks with a buffer each, and a buffer left open on a group destroyed under it."""
    import gc

    import torch.distributed as dist

    from peerdcp._runtime import groups as _dist

    backend = _twin_backend()
    ranks = list(range(dist.get_world_size()))
    seen = []
    for i in range(n):
        g = dist.new_group(ranks, backend=backend)
        buf = peerdcp.memory.allocate(4096, g, memory="host", device="cpu")
        buf.view(buf.rank, (4,), torch.int32).fill_(i)
        buf.close()
        dist.destroy_process_group(g)
        del buf, g
        gc.collect()
        seen.append(_counts())
    g1, g2 = dist.new_group(ranks, backend=backend), dist.new_group(ranks, backend=backend)
    shared = _dist.resolve_group(g1).cpu_group is _dist.resolve_group(g2).cpu_group
    b1 = peerdcp.memory.allocate(4096, g1, memory="host", device="cpu")
    b2 = peerdcp.memory.allocate(4096, g2, memory="host", device="cpu")
    b1.view(b1.rank, (1,), torch.int32).fill_(7)
    b2.close()
    dist.destroy_process_group(g1)  # b1 stays open on a destroyed group: its close() still needs the twin
    dist.destroy_process_group(g2)
    peerdcp.memory.allocate(4096, memory="host", device="cpu").close()
    b1.close()
    del b1, b2, g1, g2
    gc.collect()
    return {"seen": seen, "end": _counts(), "shared": shared}


def indexk_one_rank_bad_args(bad_rank: int) -> str:
    """Every rank builds an IndexKCache; rank ``bad_rank`` with capacity_tokens=0."""
    cap = 0 if torch.distributed.get_rank() == bad_rank else 256
    try:
        peerdcp.IndexKCache(capacity_tokens=cap, head_dim=32, page_size=16, device="cpu").close()
        return "constructed"
    except (ValueError, TypeError, PeerSetupError) as e:
        return f"{type(e).__name__}: {e}"


def _make(cls: str, backend: str):
    if cls == "output":
        return peerdcp.OutputReducer(
            max_tokens=2, heads_per_rank=1, head_dim=16, backend=backend, memory="host", device="cpu"
        )
    if cls == "query":
        return peerdcp.QueryGather(
            max_tokens=2, heads_per_rank=1, nope_dim=16, rope_dim=16, out_dtype=torch.bfloat16, backend=backend,
            memory="host", device="cpu",
        )  # fmt: skip
    return peerdcp.TopK(max_rows=2, topk=4, backend=backend, memory="host", device="cpu")


def fail_after_allocation(cls: str, backend: str, fault_rank: int) -> dict:
    """Rank ``fault_rank``'s constructor fails right after the allocation (its pinned error word, as when pinned
    memory runs out); the others' do not. Outcome, warnings and mappings per rank."""
    import gc
    import warnings
    from unittest import mock

    target = {"output": "peerdcp.output.setup", "query": "peerdcp.query.setup", "topk": "peerdcp.topk.selector"}
    before = resources()
    patch = mock.patch(f"{target[cls]}.ErrorWord", side_effect=MemoryError("injected: no pinned memory"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.distributed.get_rank() == fault_rank:
            patch.start()
        try:
            obj = _make(cls, backend)
            outcome = f"constructed {obj.backend}"
            obj.close()
        except (PeerSetupError, MemoryError) as e:
            outcome = f"{type(e).__name__}: {e} (cause {type(e.__cause__).__name__})"
        finally:
            if torch.distributed.get_rank() == fault_rank:
                patch.stop()
        gc.collect()
    torch.distributed.barrier()
    return {
        "outcome": outcome,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)],
        "before": before,
        "after": resources(),
    }


def misaligned_on_one_rank(bad_rank: int) -> dict:
    """A PeerBuffer whose last peer address is 8 bytes off on ``bad_rank`` only (a stand-in teardown counts calls)."""
    from peerdcp._runtime.groups import resolve_group
    from peerdcp.memory.buffer import PeerBuffer

    info = resolve_group(None)
    addrs = [0x10000 * (r + 1) for r in range(info.world_size)]
    if info.rank == bad_rank:
        addrs[-1] += PEER_ALIGN // 2
    released = []
    try:
        PeerBuffer(info=info, memory="host", nbytes=64, device=torch.device("cpu"), peer_bytes=[], peer_addrs=addrs,
                   teardown=lambda: released.append(1))  # fmt: skip
        raised = None
    except PeerSetupError as e:
        raised = str(e)
    return {"raised": raised, "released": len(released)}


_LOW_PAGES: set[int] = set()  # mapped by this process (the pool's workers serve several calls)


def _map_low_page(addr: int) -> int:
    """An anonymous page at exactly ``addr`` (0 where the kernel refuses: taken or below mmap_min_addr)."""
    import ctypes
    import mmap

    if addr in _LOW_PAGES:
        return addr

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    map_fixed_noreplace = 0x100000
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed_noreplace
    got = libc.mmap(addr, 4096, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != addr:
        return 0
    _LOW_PAGES.add(addr)
    return addr


def with_error_word_at(addr: int, fn_name: str, *args):
    """``fn_name(*args)`` of this module with every ErrorWord's eight words at address ``addr`` (where a
    non-PIE Python's heap puts small tensors: below 2^32, which the interpreter passes as a 32-bit scalar)."""
    import ctypes
    from unittest import mock

    from peerdcp._runtime import device

    if not _map_low_page(addr):
        return "unmappable"
    words = torch.frombuffer((ctypes.c_char * 64).from_address(addr), dtype=torch.int64, count=8)

    def init(self, device, timeout_s):
        self.timeout_s, self.device = timeout_s, device
        self.tensor = words
        self.tensor.zero_()
        self.words = words.numpy()

    with mock.patch.object(device.ErrorWord, "__init__", init):
        return globals()[fn_name](*args)
