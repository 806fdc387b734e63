"""The two-GPU Top-K suite's rank functions at world 1 on one GPU: a smoke check of ``TopK.select`` end to end
(local selection, publish, merge) when no second GPU is lent. Not a substitute for ``tests/test_topk_gpu.py``: with
one rank nothing crosses a link and the merge sees one list.

    python3 scripts/diag/topk_world1.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import rankfns_topk as fns  # noqa: E402

from peerdcp.launch import RankPool  # noqa: E402


def main() -> int:
    bad = 0
    with RankPool(1, backend="cpu:gloo,cuda:nccl") as pool:
        for memory in ("symm",):  # (vmm needs NVLink: ineligible on a one-GPU machine)
            for merge in ("cuda", "triton"):
                for k, lens in (
                    (16, [0, 1, 13, 16, 17, 320, 37]),
                    (2048, [0, 1, 2047, 2048, 2049, 4095, 50_000, 131_072]),
                ):
                    res = pool.run(fns.exactness, k, (1, 64), lens, 4, memory=memory, device="cuda", merge_impl=merge)
                    ok = all(
                        c["direct"] and c["allgather"] and c["direct_owned"] and c["allgather_owned"] for c in res[0]
                    )
                    ok &= all(c["direct_digest"] == c["expect_digest"] == c["allgather_digest"] for c in res[0])
                    print(f"exactness memory={memory} merge={merge} k={k}: {'ok' if ok else 'FAIL'}", flush=True)
                    bad += not ok
                res = pool.run(fns.graph_exactness, 64, 1, memory, "direct", 10, 5, merge_impl=merge)
                ok = all(res[0]["ok"])
                print(f"graph memory={memory} merge={merge}: {'ok' if ok else 'FAIL'}", flush=True)
                bad += not ok
                res = pool.run(fns.back_to_back, 200, 64, 1, 8, 17, memory=memory, device="cuda", merge_impl=merge)
                ok = all(res[0]["ok"])
                print(f"back-to-back memory={memory} merge={merge}: {'ok' if ok else 'FAIL'}", flush=True)
                bad += not ok
    print(f"world-1 Top-K smoke: {'PASS' if bad == 0 else f'{bad} FAILED'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
