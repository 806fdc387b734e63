"""Diagnostic (GPU, W=2): run single Query paths of the T=256 / H=32 matrix case many times, each call
bounded, and print one line per run - which path stalls, how often, and how long each run took.

    python3 scripts/diag/query_paths_loop.py [repeats]
"""

import sys
import time

sys.path.insert(0, "tests")
import rankfns_query as fns  # noqa: E402
import torch  # noqa: E402

from peerdcp.launch import RankPool  # noqa: E402

CASE = dict(style="interleaved", out=torch.float8_e4m3fn, table="deepseek-v3.2", T=256, H=32)
PATHS = [("triton", "roped"), ("triton", "raw"), ("triton", "exposed"), ("cuda", "roped"), ("triton", "allgather")]


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    pool = RankPool(2, backend="cpu:gloo,cuda:nccl")
    tally: dict = {}
    try:
        for rep in range(repeats):
            for impl, ex in PATHS:
                t0 = time.time()
                try:
                    res = pool.run(fns.one_path, CASE, impl, ex, "vmm", timeout=40)
                    line = " ".join(f"r{i}:ok={r['ok']},err={r['error']},{r['seconds']}s" for i, r in enumerate(res))
                    good = all(r["ok"] and r["error"] is None for r in res)
                except Exception as e:  # noqa: BLE001 - a stalled pool is the finding
                    line, good = f"STALL/ERROR {type(e).__name__}: {str(e)[-300:]}", False
                    pool.close(force=True)
                    pool = RankPool(2, backend="cpu:gloo,cuda:nccl")
                tally.setdefault(f"{impl}-{ex}", []).append(good)
                verdict = "PASS" if good else "FAIL"
                print(f"rep {rep} {impl}-{ex}: {verdict} ({time.time() - t0:.1f}s) {line}", flush=True)
    finally:
        pool.close(force=True)
    for k, v in tally.items():
        print(f"{k:18s} {sum(v)}/{len(v)} passed")


if __name__ == "__main__":
    main()
