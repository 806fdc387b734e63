"""Side-by-side table of an A/B of the local Top-K selection: ``scripts/ab_bench.sh bench.topk --world 1 --no-merge
--no-indexer --local ...`` leaves ``ab-<build><round>.log`` in OUT; this prints one line per shape (local scores,
rows, the rule's CTAs per row C) with every build and round as ``cuda / cuda_1cta`` µs (the rule's CTAs per row / one
CTA per row; ``!`` after a pair: that run's selection was not exact).

    python3 scripts/ab_local_table.py OUT
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

ROW = re.compile(r"^ +(\d+) +(\d+) +(\w+) +(\d+) +([\d.]+) +([\d.]+)")


def main(out: str) -> None:
    runs: dict[tuple[int, int], dict[str, str]] = collections.defaultdict(dict)
    ctas: dict[tuple[int, int], str] = {}
    for log in sorted(Path(out).glob("ab-*.log")):
        name = log.stem[3:]
        for line in log.read_text().splitlines():
            m = ROW.match(line)
            if m:
                ctas[(int(m[1]), int(m[2]))] = m[4]
                runs[(int(m[1]), int(m[2]))][name] = f"{float(m[5]):.2f}/{float(m[6]):.2f}" + (
                    "" if m[3] == "True" else "!"
                )
    names = sorted({n for v in runs.values() for n in v})
    print("local_len rows C " + " ".join(names) + "  (cuda / cuda_1cta, us)")
    for shape in sorted(runs):
        print(*shape, ctas[shape], *(runs[shape].get(n, "-") for n in names))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
