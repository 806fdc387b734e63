"""Where does the Output sentinel kernel's time go? (GPU machine, W = 2)

    python3 scripts/diag/sentinel_timeline.py [--tokens 64 128 256] [--reps 5]

For each role layout of the sentinel kernel (every CTA publishes then combines; the first n CTAs publish, the
others combine) and each T, runs eager calls with the kernel's diagnosis timeline on (per CTA: start,
publish done, combine done, SM id; ns of the GPU's globaltimer; ``OutputDirectParams.dbg``), each right after
an unrecorded call (which roughly aligns the ranks: it ends on both once both published). Prints per rank,
relative to the call's earliest CTA start: the spread of the starts, when the publishers finished (min /
median / max), when the combiners finished, and on how many distinct SMs the publishers ran. The last
repetition is reported (the first ones warm up). The ranks' globaltimers are not one clock ("skew").
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch


def _variants(publishers: list[int]) -> dict:
    return {
        ("unified" if n == 0 else f"split-{n}"): {
            "cuda_opts": ("pdl", "sentinel"), "cuda_sentinel_min_tokens": 0, "cuda_sentinel_split": ((0, n, 2),),
        }
        for n in publishers
    }  # fmt: skip


def _q(x: torch.Tensor) -> str:
    if x.numel() == 0:
        return "     -"
    x = x.double().sort().values / 1000.0
    return f"{x[0]:6.2f} {x[len(x) // 2]:6.2f} {x[-1]:6.2f}"


def rank_main(cfg: dict) -> list[str]:
    import torch.distributed as dist

    import peerdcp
    from bench.common import device_barrier
    from peerdcp.output import reducer as R

    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    H, D = 16, 512
    lines = []
    for name, tuning in _variants(cfg["publishers"]).items():
        with mock.patch.dict(R.TUNING, tuning):
            red = peerdcp.OutputReducer(
                None, max_tokens=max(cfg["tokens"]), heads_per_rank=H, head_dim=D, backend="direct", memory="vmm",
                kernel="cuda", device=dev, ll_max_tokens=0, ll128_max_tokens=0,
            )  # fmt: skip
        G = red.programs
        dbg = torch.zeros(G * 4, dtype=torch.int64, device=dev)
        red._launch_cuda._p.dbg = dbg.data_ptr()
        for T in cfg["tokens"]:
            g = torch.Generator(device="cuda").manual_seed(T)
            po = torch.randn(T, W * H, D, generator=g, device=dev).to(torch.bfloat16)
            pl = torch.randn(T, W * H, generator=g, device=dev)
            for _ in range(cfg["reps"]):
                dbg.zero_()
                device_barrier()
                torch.cuda._sleep(cfg["lead_cycles"])  # the host enqueues both calls before the GPU gets there
                # the first call aligns the ranks (each completes once the other's data is there; the timed call
                # starts on both right after it, by stream order), the second one is recorded
                red._launch_cuda._p.dbg = None
                red.reduce(po, pl)
                red._launch_cuda._p.dbg = dbg.data_ptr()
                red.reduce(po, pl)
                torch.cuda.synchronize()
            t = dbg.view(G, 4).cpu()
            start = t[:, 0]
            base = int(start.min())
            is_pub = ((t[:, 3] >> 16) & 1).bool()  # the kernel's role bit
            is_cons = ~is_pub if not bool(is_pub.all()) else is_pub  # split: the combiners
            sms_pub = len(set((t[is_pub, 3] & 0xFFFF).tolist()))
            bases = [None] * W
            dist.all_gather_object(bases, base)  # globaltimer skew between the ranks' first CTAs (same clock?)
            lines.append(
                f"rank {rank} {name:11} T={T:<4} skew {(base - min(bases)) / 1000:7.2f} start {_q(start - base)}"
                f" | publish done {_q(t[is_pub, 1] - base)}"
                f" | combine done {_q(t[is_cons, 2] - base)} | publisher SMs {sms_pub}/{int(is_pub.sum())}"
            )
        red._launch_cuda._p.dbg = None
        red.check()
        red.close()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--publishers", nargs="+", type=int, default=[0, 32], help="publisher CTAs; 0: every CTA both")
    ap.add_argument("--lead-cycles", type=int, default=200_000, help="GPU sleep between the barrier and the call")
    a = ap.parse_args()
    from bench.common import run_ranks

    res = run_ranks(
        "scripts.diag.sentinel_timeline:rank_main",
        2,
        dict(tokens=a.tokens, reps=a.reps, lead_cycles=a.lead_cycles, publishers=a.publishers),
    )
    print("µs after the call's first CTA start: min median max over CTAs")
    for lines in res:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
