"""The Top-K benchmark's code paths on CPU (two gloo ranks, the Triton interpreter, tiny sizes): it runs to the
end, every compared selection is exact, and its JSON is standard (no NaN). Times mean nothing here.

(A Triton import in the benchmark's parent process breaks its CPU ranks' interpreter launches; without this
test only a GPU run would show it.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_topk_cpu_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "bench.topk", "--cpu-smoke", "--local", "--local-scores", "indexer"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    text = (tmp_path / "topk.json").read_text()

    def reject(c: str):
        raise AssertionError(f"non-standard JSON constant {c}")

    res = json.loads(text, parse_constant=reject)
    assert res["merge"] and res["indexer"] and res["local"], res.keys()
    assert all(row["exact"] for row in res["merge"] + res["indexer"] + res["local"]), res
    assert {row["bytes_ratio"] for row in res["indexer"]} == {0.5}, res["indexer"]
    assert res["config"]["local_scores"] == "indexer", res["config"]
