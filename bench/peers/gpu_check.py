"""The peers' one-GPU checks: ``python -m bench.peers.gpu_check`` prints one line per issue-54 peer.

vLLM's a2a pack + combine runs for 2 and 4 simulated ranks on this GPU (the all-to-all is a permutation done by
indexing) and is compared with peerdcp's fp32 bound; the other peers are listed with the reason they are skipped.
"""

from __future__ import annotations

import torch

from bench import peers


def main() -> int:
    """Print the peers' lines; returns 0 (a different answer is a finding, not an error)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for world in (2, 4):
        print(f"vllm-a2a W={world}:", peers.check_vllm_a2a(dev, world=world))
    for line in peers.report_lines(None) + [f"peer {n}: skipped: {w}" for n, w in peers.QUERY_PEERS + peers.TOPK_PEERS]:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
