"""Diagnose: twins failure detail, symm graph replay hang (small counts, short timeouts)."""

import sys
import time

sys.path.insert(0, "tests")
import rankfns_output as fns
import torch

from peerdcp.launch import RankPool

NCCL = "cpu:gloo,cuda:nccl"


def cfg(memory, kernel, timeout_s=2.0, ll=None):
    c = dict(
        max_tokens=256,
        dtype=torch.bfloat16,
        backend="direct",
        lse_base="e",
        timeout_s=timeout_s,
        heads_per_rank=16,
        head_dim=512,
        memory=memory,
        kernel=kernel,
    )
    if ll is not None:
        c["ll_max_tokens"] = ll
    return c


def go(name, fn, *a, timeout=60):
    global pool
    t0 = time.time()
    try:
        r = pool.run(fn, *a, timeout=timeout)
    except Exception as e:
        r = "ERR " + str(e)[-1500:]
        if pool.broken:
            pool = RankPool(2, backend=NCCL)
    print(f"### {name} ({time.time() - t0:.1f}s): {r}", flush=True)


def main():
    global pool
    pool = RankPool(2, backend=NCCL)
    go("twins vmm", fns.cuda_triton_twins, "vmm", [1, 3, 64, 256], 61)
    go("graph vmm cuda 5", fns.graph_replays, cfg("vmm", "cuda"), 5, 128, 3)
    go("graph symm cuda 5", fns.graph_replays, cfg("symm", "cuda"), 5, 128, 3)
    go("graph symm plain 5", fns.graph_replays, cfg("symm", "cuda", ll=0), 5, 128, 3)
    go("graph symm triton 5", fns.graph_replays, cfg("symm", "triton"), 5, 128, 3)
    go("graph symm cuda 3000", fns.graph_replays, cfg("symm", "cuda"), 3000, 128, 3, timeout=60)
    pool.close()


if __name__ == "__main__":
    main()
