"""The peers' one-GPU checks: ``python -m bench.peers.gpu_check`` prints one line per issue-54 peer.

Every peer check that runs on one GPU, on simulated ranks (an exchange between them is a permutation or a
concatenation done by indexing):

* vLLM ``fused_q`` (BF16 and FP8 outputs, W = 2 and 4) against ``widened_query``: byte-equal, else inside
  ``widened_query_bounds`` (bench.peers.fused_q says why that bound);
* vLLM's Top-K pack (top-k 2048, W = 2 and 4, interleave 1 and 64) and symmetric-memory push against
  ``canonical_topk`` (bench.peers.topk);
* vLLM's a2a pack + combine and its ag_rs correction kernel + a bf16 reduce-scatter sum (W = 2 and 4) against
  peerdcp's fp32 bound.

Each line is ``peer NAME: ran, matches (...)``, ``peer NAME: ran, DIFFERENT (...)`` or ``peer NAME: skipped: why``;
the process exits 0 either way (a different answer is a finding), 1 only when a check raised.
"""

from __future__ import annotations

import traceback

import torch

from bench import peers


def _line(name: str, ok: bool | None, detail: str) -> str:
    if ok is None:
        return f"peer {name}: skipped: {detail}"
    return f"peer {name}: ran, {'matches' if ok else 'DIFFERENT'} ({detail})"


def main() -> int:
    """Print the peers' lines."""
    from bench.peers import fused_q, topk

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}")
    if dev == "cpu":
        print(
            "note: under TRITON_INTERPRET=1 Triton's bf16 / e4m3 casts are not the GPU's round-to-nearest-even, so a "
            "DIFFERENT verdict of fused_q, a2a or ag_rs here is the interpreter's; the GPU run decides"
        )
    failed = 0
    checks = []
    for dt in (torch.bfloat16, torch.float8_e4m3fn):
        for world in (2, 4):
            shape = dict(T=32, H=32) if dev == "cuda" else {}  # 32 heads per rank: the bench.query target shape
            checks.append(
                (fused_q.NAME, lambda dt=dt, w=world, s=shape: [fused_q.check(dev, world=w, out_dtype=dt, **s)])
            )
    for world, inter in ((2, 1), (4, 64)):
        checks.append(
            (None, lambda w=world, i=inter: topk.check(dev, world=w, rows=4, L=w * 2048 + 1000, k=2048, interleave=i))
        )
    for world in (2, 4):
        checks.append(("vllm-a2a", lambda world=world: [peers.check_vllm_a2a(dev, world=world)]))
    for world in (2, 4):
        checks.append(("vllm-ag_rs", lambda world=world: [peers.check_vllm_ag_rs(dev, world=world)]))
    for name, fn in checks:
        try:
            for res in fn():
                n, (ok, detail) = (res[0], res[1:]) if name is None else (name, res)
                print(_line(n, ok, detail), flush=True)
        except Exception as e:  # noqa: BLE001 - reported per peer, the other checks still run
            failed = 1
            print(f"peer {name or 'vllm-topk'}: ERROR {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    for name, _, why in peers.status():
        if name not in ("vllm-a2a", "vllm-ag_rs"):
            print(_line(name, None, why))
    for name, why in peers.QUERY_PEERS + peers.TOPK_PEERS:
        print(_line(name, None, why))
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
