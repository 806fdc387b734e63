"""Where a Query path's bytes differ from the fp32 reference (ranks sharing one GPU: PEERDCP_SHARED_GPU=1).

Written for a rope_dim 512 case with out-of-table positions (`fp8-interleaved-T5-H2-rope512-oob`) whose Triton
roped / push paths differed on the GPU while CUDA, Triton raw / exposed and both allgathers matched (the cause: an
unaligned peer-slot pointer, see ``peerdcp.query.kernels._slot_pointer``). This prints,
per case variant and path, how many bytes differ, where (token, widened head, nope / rope part) and a sample.

    PEERDCP_SHARED_GPU=1 python3 scripts/diag/query_mismatch.py [--world 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import rankfns_query as fns  # noqa: E402

from peerdcp.launch import RankPool  # noqa: E402

FP8 = torch.float8_e4m3fn


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    base = dict(style="interleaved", out=FP8, T=5, H=2)
    variants = {
        "rope512-oob": dict(base, rope=512, oob=True),
        "rope512": dict(base, rope=512),
        "rope256-oob": dict(base, rope=256, oob=True),
        "rope128-oob": dict(base, rope=128, oob=True),
        "rope64-oob": dict(base, rope=64, oob=True),
        "rope512-bf16": dict(base, rope=512, out=torch.bfloat16),
        "rope512-neox": dict(base, rope=512, style="neox"),
        "rope512-T1": dict(base, rope=512, T=1),
        "rope512-H1": dict(base, rope=512, H=1),
        "rope512-nope128": dict(base, rope=512, nope=128),
    }
    pool = RankPool(args.world, backend="cpu:gloo,cuda:gloo")
    try:
        for name, case in variants.items():
            for impl, ex in (("triton", "roped"), ("triton", "push"), ("triton", "raw"), ("cuda", "roped")):
                res = pool.run(fns.mismatch_map, case, impl, ex)
                line = {f"r{r}": {k: v for k, v in d.items() if k != "pos"} for r, d in enumerate(res)}
                bad = sum(d["bad"] for d in res)
                print(f"{name:16s} {impl:6s} {ex:6s} bad={bad:6d}  {json.dumps(line) if bad else ''}", flush=True)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
