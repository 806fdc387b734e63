import sys
import time

sys.path.insert(0, "tests")
import rankfns_query as fns  # noqa: E402
import torch  # noqa: E402

from peerdcp.launch import RankPool  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
CASES = [
    dict(style="neox", out=FP8, scale=0.5, pad=64, T=37, H=16, pos32=True),
    dict(style="interleaved", out=FP8, scale=2.0, mag=300.0, specials=True, T=9, H=8),
    dict(style="neox", out=BF16, T=5, H=64),
    dict(style="interleaved", out=FP8, table="deepseek-v3.2", T=256, H=32),
]


def main():
    pool = RankPool(2, backend="cpu:gloo,cuda:nccl")
    for c in CASES:
        t0 = time.time()
        try:
            res = pool.run(fns.gather_matrix, [c], memory="vmm", impls=("cuda", "triton"), timeout=60)
            r = res[0][0]
            print("CASE", c["out"], "all_equal", r["all_equal"], flush=True)
            for k, v in r["paths"].items():
                print("  ", k, {q: v[q] for q in ("bitwise_fp32", "max_steps_fp64", "nan")}, flush=True)
        except Exception as e:  # noqa: BLE001
            print("ERR", str(e)[-800:], flush=True)
        print(f"  ({time.time() - t0:.1f}s)", flush=True)
    pool.close(force=True)


if __name__ == "__main__":
    main()
