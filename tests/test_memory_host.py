"""Foundation: host peer memory across real processes, the interpreted Triton signal round trip,
leaks, rollback, bad input and the probe."""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import pytest
from on_ranks import memory as fns


@pytest.mark.parametrize("world", [2, 3, 4])
def test_host_write_read_every_peer(pools, world):
    res = pools(world).run(fns.write_read_all, 4 * world * 1000 + 12)
    for r in res:
        assert r == {"zero": True, "ok": True, "reads": True, "closed": True}


@pytest.mark.parametrize("world", [2, 3])
def test_fill_collective_lands_everywhere_before_it_returns(pools, world):
    for r in pools(world).run(fns.fill_collective, 4096, 256, 1000, 0xFF):
        assert r["filled"] and r["rest"], r
        assert len(r["errors"]) == 3, r  # bad offset, range past the end, value not a byte: ValueError each


@pytest.mark.parametrize("world", [2, 4])
def test_interpreted_kernel_signal_roundtrip(pools, world):
    res = pools(world).run(fns.kernel_roundtrip, 3, 37)
    assert res == [[True, True, True]] * world


def test_missing_peer_times_out(pools):
    res = pools(2).run(fns.roundtrip_missing_peer, 1, 2.0)
    assert res[1] == "absent"
    assert res[0].startswith("timeout rank=0 peer=1 mech=signal-test"), res[0]
    dt = float(res[0].split("dt=")[1])
    assert 0.5 < dt < 10.0, dt


def test_200_cycles_leave_nothing(pools):
    res = pools(2).run(fns.cycle, 200, 1 << 14)
    for r in res:
        assert r["after"]["fds"] <= r["before"]["fds"], r
        assert r["after"]["maps"] == r["before"]["maps"] == 0, r
        assert r["after"]["shm"] == 0, r
    assert glob.glob("/dev/shm/peerdcp-*") == []


@pytest.mark.parametrize("stage", ["create", "map", "unlink"])
def test_failing_rank_rolls_back_everywhere(pools, stage):
    res = pools(3).run(fns.faulty_allocate, 1, stage)
    for r in res:
        assert r["outcome"].startswith("PeerSetupError"), r
        assert "rank 1" in r["outcome"] and stage in r["outcome"], r
        # /dev/shm is checked below, once every rank has returned (a peer may still be rolling back)
        assert (r["after"]["fds"], r["after"]["maps"]) == (r["before"]["fds"], r["before"]["maps"]), r
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_bad_arguments_raise_before_allocating(pools):
    res = pools(2).run(fns.bad_args)
    assert res == [["ValueError", "ValueError", "TypeError", "ValueError", "ValueError"]] * 2


def test_probe_in_group(pools):
    res = pools(2).run(fns.probe_json)
    for d in res:
        assert d["world_size"] == 2 and d["kinds"]["host"]["eligible"] is True
        assert d["kinds"]["vmm"]["eligible"] is False and d["kinds"]["vmm"]["reasons"]


def test_probe_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "peerdcp", "probe", "--json"], capture_output=True, text=True, check=True
    )
    d = json.loads(out.stdout)
    assert d["kinds"]["host"]["eligible"] is True
    assert set(d["kinds"]) == {"vmm", "symm", "host"}
    if not d["cuda"]:
        assert any("CUDA" in r for r in d["kinds"]["vmm"]["reasons"])


def _gpu_facts(uuids: list[str], device: int, shared: bool) -> dict:
    """A rank's probe facts on a machine with GPUs ``uuids`` (P2P and atomics both ways, 18 NVLink links)."""
    p2p = {u: {"to": 1, "from": 1, "atomics": 1} for i, u in enumerate(uuids) if i != device}
    return {"cuda": True, "host": "h", "pid": 1, "shared_gpu": shared, "uuids": uuids, "names": ["H200"] * len(uuids),
            "device": device, "driver": True, "vmm": 1, "posix_fd": 1, "fabric_attr": 0, "fabric_trial": "ok",
            "p2p": p2p, "nvlink": 18, "symm": True}  # fmt: skip


@pytest.mark.parametrize("shared", [False, True])
def test_probe_ranks_sharing_a_gpu(shared):
    """Two ranks on one GPU: refused ("distinct devices"), unless every rank opted in (PEERDCP_SHARED_GPU=1),
    which makes vmm eligible (no link needed on one GPU, even where NVML counts none) and never symm."""
    from peerdcp.memory.probe import _evaluate

    one = [_gpu_facts(["GPU-a"], 0, shared) | {"nvlink": 0} for _ in range(2)]
    for rank in range(2):
        rep = _evaluate(one, rank)
        assert rep["vmm"].eligible is shared, rep["vmm"].reasons
        assert rep["symm"].eligible is False, rep["symm"].reasons
        if not shared:
            assert any(r.startswith("distinct devices") for r in rep["vmm"].reasons), rep["vmm"].reasons
        else:
            assert any("one rank per GPU" in r for r in rep["symm"].reasons), rep["symm"].reasons
    # one rank without the opt-in refuses for all; 4 ranks on 2 GPUs need the link between the two GPUs
    assert not _evaluate([one[0], _gpu_facts(["GPU-a"], 0, False)], 0)["vmm"].eligible
    two = ["GPU-a", "GPU-b"]
    four = [_gpu_facts(two, r % 2, True) for r in range(4)]
    assert _evaluate(four, 3)["vmm"].eligible is True
    assert _evaluate([f | {"nvlink": 0} for f in four], 3)["vmm"].eligible is False
    # one rank per GPU is unchanged by the opt-in: symm eligible
    assert _evaluate([_gpu_facts(two, r, shared) for r in range(2)], 1)["symm"].eligible is True


def test_ranks_share_gpus_only_with_fewer_gpus_than_ranks(monkeypatch):
    """The opt-in takes effect only with 1 <= GPUs < ranks (``peerdcp run`` and the test pools both ask this)."""
    from unittest import mock

    from peerdcp.memory.probe import ranks_share_gpus

    for env, ngpu, world, want in [("1", 1, 8, True), ("1", 2, 4, True), ("1", 2, 2, False), ("1", 0, 2, False),
                                   ("0", 1, 8, False), ("", 1, 2, False)]:  # fmt: skip
        monkeypatch.setenv("PEERDCP_SHARED_GPU", env)
        with (
            mock.patch("torch.cuda.is_available", return_value=ngpu > 0),
            mock.patch("torch.cuda.device_count", return_value=ngpu),
        ):
            assert ranks_share_gpus(world) is want, (env, ngpu, world)


def test_bad_argument_on_one_rank_raises_on_every_rank(pools):
    """A bad argument on rank 1 raises there (ValueError / TypeError) and a PeerSetupError naming it on rank 0,
    which used to wait for rank 1 in the probe's all-gather until the process group's timeout."""
    res = pools(2).run(fns.one_rank_bad_args, 1, timeout=120)
    assert [m.split(":")[0] for m in res[1]] == ["ValueError", "TypeError", "ValueError"], res[1]
    for m in res[0]:
        assert m.startswith("PeerSetupError: allocate: bad arguments on rank 1"), res[0]
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_close_after_a_peer_died_raises_and_unmaps(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = str(tmp_path / "init")
    procs = [ctx.Process(target=fns.close_after_peer_died, args=(r, 2, init, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        r = q.get(timeout=120)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert r["mapped"] == 2, r
    assert r["outcome"].startswith("PeerSetupError: host close"), r
    assert r["closed"] and r["after"] == 0, r
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_a_full_dev_shm_is_a_setup_error_on_every_rank(pools):
    """posix_fallocate reserves the segment's pages at allocation: a /dev/shm that cannot back them fails there,
    on every rank, instead of a SIGBUS at the first store (here ENOSPC is injected on rank 1)."""
    res = pools(2).run(fns.allocate_without_space, 1)
    for r in res:
        assert r.startswith("PeerSetupError") and "rank 1" in r and "No space" in r, r
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_gloo_twins_do_not_grow_with_groups(pools):
    """Groups that are not gloo get a gloo twin (``_dist.resolve_group``); torch keeps every group, with its sockets
    and threads, until it is destroyed. A twin per group leaked 5 fds and 2 threads with every group created and
    destroyed: groups of the same ranks now share one, also while both are alive, and an object left open on a
    destroyed group still closes over it."""
    res = pools(2).run(fns.twin_cycles, 12, timeout=240)
    for r in res:
        seen, end = r["seen"], r["end"]
        assert r["shared"], r
        for key in ("fds", "threads", "groups"):
            # from the first cycle on the twin exists; eleven more groups must add nothing, nor the tail
            assert max(s[key] for s in seen) <= seen[0][key], (key, seen)
            assert end[key] <= seen[0][key], (key, end, seen[0])


def test_index_k_cache_bad_argument_on_one_rank_raises_on_every_rank(pools):
    """IndexKCache checked its arguments before its geometry exchange: the good rank waited there (45 s and more)."""
    res = pools(2).run(fns.indexk_one_rank_bad_args, 1, timeout=60)
    assert res[1].startswith("ValueError: IndexKCache: capacity_tokens"), res
    assert res[0].startswith("PeerSetupError") and "rank 1" in res[0], res


@pytest.mark.parametrize(
    "cls, backend, expect",
    [
        ("output", "direct", "PeerSetupError"),
        ("output", "auto", "constructed a2a"),  # auto falls back on every rank, as for a failed allocation
        ("query", "direct", "PeerSetupError"),
        ("topk", "direct", "PeerSetupError"),
        ("topk", "allgather", "PeerSetupError"),  # no buffer, but its calls are collective: agreed as well
    ],
)
def test_failure_after_the_allocation_on_one_rank_is_agreed(pools, cls, backend, expect):
    """A local step after the collective allocation failed on one rank: that rank raised and left its buffer to the
    garbage collector (a ResourceWarning, mappings kept), the other got an object whose calls time out and whose
    close() waited for the failed rank. Now every rank closes the buffer and raises (or, with auto, falls back)."""
    res = pools(2).run(fns.fail_after_allocation, cls, backend, 1, timeout=120)
    for r in res:
        assert r["outcome"].startswith(expect), res
        if expect == "PeerSetupError":
            assert "rank 1" in r["outcome"] and "injected" in r["outcome"], res
        assert r["warnings"] == [], res
        assert r["after"]["maps"] == r["before"]["maps"], res
    assert "cause MemoryError" in res[1]["outcome"] or expect != "PeerSetupError", res
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_misaligned_peer_addresses_on_one_rank_are_a_setup_error_on_every_rank(pools):
    """The Triton kernels declare every peer base 16-byte aligned (``_runtime.device.peer_pointer``): a buffer whose
    addresses are not, on any one rank, is refused on every rank (agreed: none is left holding a buffer another
    rank never joined), and each rank's mapping is torn down."""
    for r in pools(3).run(fns.misaligned_on_one_rank, 1):
        assert r["released"] == 1 and "rank 1" in r["raised"] and "aligned" in r["raised"], r


@pytest.mark.parametrize("addr", [0x1000_0000, 0xC000_0000], ids=["int32", "uint32"])
def test_error_word_below_4gib_in_the_interpreter(pools, addr):
    """The error word's address as a 32-bit scalar (below 2^31: int32, below 2^32: uint32), as on a machine whose
    Python is not position-independent (its heap lies there, as on the GPU machines): the signal round trip works
    and a missing peer still writes the word and times out."""
    res = pools(2).run(fns.with_error_word_at, addr, "kernel_roundtrip", 2, 37)
    if "unmappable" in res:
        pytest.skip(f"cannot map a page at {addr:#x} here")
    assert res == [[True, True], [True, True]], res
    res = pools(2).run(fns.with_error_word_at, addr, "roundtrip_missing_peer", 1, 2.0)
    assert res[1] == "absent" and res[0].startswith("timeout rank=0 peer=1 mech=signal-test"), res
