"""Diagnostic (GPU, W=2): the zero-copy (exposed) Query path of the T=256 / H=32 case, repeated; after each
call every rank synchronizes and reports the error word and its flag header (ready[2][NPROG][W] and
ack[NPROG][W]), so a failed wait shows whether the peer's flag never came, came late, or carried another
value.

    python3 scripts/diag/query_exposed_probe.py [repeats] [impl]
"""

import sys
import time

sys.path.insert(0, "tests")
import rankfns_query as fns  # noqa: E402
import torch  # noqa: E402

from peerdcp.launch import RankPool  # noqa: E402

CASE = dict(style="interleaved", out=torch.float8_e4m3fn, table="deepseek-v3.2", T=256, H=32)


def probe(case: dict, impl: str, calls: int) -> dict:
    import torch.distributed as dist

    from peerdcp.query import QueryGather

    T, nopes, pes, pos, cs, r32, _, common = fns.case_setup(case, 2000 + case["T"])
    me, W = dist.get_rank(), dist.get_world_size()
    res = []
    gpu = torch.cuda.is_available()
    mem = "vmm" if gpu else "host"
    with QueryGather(backend="direct", memory=mem, exchange="raw", impl=impl, timeout_s=3.0, **common) as qg:
        NP = qg.num_programs
        for c in range(calls):
            t0 = time.perf_counter()
            zn, zp = qg.exposed_shard(T)
            zn.copy_(nopes[me])
            zp.copy_(pes[me])
            out = qg.gather_exposed(pos, cs, out=fns.poisoned(qg, T))
            if gpu:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            hdr = qg._buf.view(me, (3 * NP * W,), torch.int64).cpu()
            ready = hdr[: 2 * NP * W].view(2, NP, W)
            ack = hdr[2 * NP * W :].view(NP, W)
            e = int(qg._epochs.max())
            peer = 1 - me
            par = e % 2
            got = ready[par, :, peer]
            bits = torch.uint8 if case["out"] == fns.FP8 else torch.int16
            res.append(
                {
                    "call": c,
                    "epoch": e,
                    "epochs_minmax": (int(qg._epochs.min()), int(qg._epochs.max())),
                    "ok": bool(torch.equal(out.cpu().view(bits), r32.view(bits))),
                    "err": [int(x) for x in qg._err.tensor[:5]],
                    "ready_eq_e": int((got == e).sum()),
                    "ready_vals": sorted({int(x) for x in got.tolist()}),
                    "ack_vals": sorted({int(x) for x in ack[:, peer].tolist()}),
                    "last_z": sorted({int(x) for x in qg._last_z.tolist()}),
                    "NP": NP,
                    "s": round(dt, 3),
                }
            )
            if qg._err.tensor[0] != 0:
                break
    return {"rank": me, "calls": res}


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    impl = sys.argv[2] if len(sys.argv) > 2 else "triton"
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    case = CASE if torch.cuda.is_available() else dict(CASE, T=3, H=2)  # CPU: a smoke run of the script
    pool = RankPool(2, backend=backend)
    try:
        for rep in range(repeats):
            t0 = time.time()
            try:
                out = pool.run(probe, case, impl, 3, timeout=45)
                for r in out:
                    for c in r["calls"]:
                        print(f"rep {rep} rank {r['rank']} {c}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"rep {rep} STALL/ERROR {type(e).__name__}: {str(e)[-400:]}", flush=True)
                pool.close(force=True)
                pool = RankPool(2, backend=backend)
            print(f"rep {rep} took {time.time() - t0:.1f}s", flush=True)
    finally:
        pool.close(force=True)


if __name__ == "__main__":
    main()
