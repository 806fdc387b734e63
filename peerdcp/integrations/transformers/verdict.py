"""The parity verdict of ``peerdcp generate``: exact where exactness is owed, margin-aware where bf16 moves bits.

1. Every exchange is exact on its own inputs, at every layer and step of the teacher-forced decode
   (:mod:`.checks`): the query's bytes, the top-k ids, the merge inside the fp32 error model; and the merged
   attention output is within 1e-2 (norm-wise) of the unsharded attention over every rank's tokens.
2. Teacher-forced on the reference's tokens with the selections pinned to DCP's (the top-k ids, and the experts
   of every MoE router: both are discrete choices downstream of attention), every step's logits are
   within ``bound = 8 bf16 ulps of the step's largest |logit|`` of the unsharded model's. What remains between the
   two is the merge of bf16 partial outputs (about one bf16 ulp of each attention output) carried through the
   layers to bf16 logits: measured up to 1 ulp on the tiny configs (without pinning the routers, one flipped
   expert of a near tie moved a logit by 10 ulps).
3. Free-running greedy tokens equal the reference's up to the first step whose reference top-1 / top-2 margin is
   below twice that bound (a near tie, where 2. allows either token); after such a step the sequences may part.
   Every rank's tokens are identical.

Random weights give near ties, so 3. alone cannot be the test; 1. and 2. are.
"""

from __future__ import annotations

import math

__all__ = ["bf16_ulp", "logit_bound", "verdict", "ULPS"]

ULPS = 8


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at ``|x|`` (8 significant bits)."""
    x = abs(x)
    if x == 0 or not math.isfinite(x):
        return 2.0**-133 if x == 0 else math.inf
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def logit_bound(max_abs: float) -> float:
    """The teacher-forced bound of a step whose largest reference |logit| is ``max_abs``."""
    return ULPS * bf16_ulp(max_abs)


def verdict(ref_free: dict, forced: list[dict], ref_forced: dict, dcp_free: list[dict]) -> dict:
    """Combine the phases' results (``forced`` and ``dcp_free`` per rank) into the verdict.

    Returns ``{"ok", "failures": [str], "mechanisms": {...}, "teacher_forced": {...}, "free_running": {...}}``;
    each failure names the mechanism or the part of the verdict that failed.
    """
    failures: list[str] = []
    mech: dict[str, dict] = {}
    for r, res in enumerate(forced):
        for name, st in res["checks"].items():
            m = mech.setdefault(name, {"calls": 0, "bad_calls": 0, "first": None})
            m["calls"] += st["calls"]
            m["bad_calls"] += st["bad_calls"]
            if st["first"] and m["first"] is None:
                m["first"] = f"rank {r}, {st['first']}"
    for name, m in mech.items():
        if m["bad_calls"]:
            failures.append(f"{name}: {m['bad_calls']} of {m['calls']} checked calls wrong ({m['first']})")

    worst, worst_at = 0.0, None
    bounds = [[logit_bound(a) for a in row] for row in ref_forced["max_abs"]]
    for b, (drow, brow) in enumerate(zip(ref_forced["max_diff"], bounds)):
        for i, (d, bd) in enumerate(zip(drow, brow)):
            ratio = d / bd if math.isfinite(d) else math.inf
            if ratio > worst:
                worst, worst_at = ratio, (b, i, d, bd)
    tf = {
        "worst_ratio": worst,
        "ulps": ULPS,
        "router_rows_pinned": ref_forced.get("router_rows_pinned", 0),
        "topk_calls_pinned": ref_forced.get("topk_calls_pinned", 0),
    }
    if worst_at:
        tf.update(row=worst_at[0], step=worst_at[1], max_diff=worst_at[2], bound=worst_at[3])
    if worst > 1:
        b, i, d, bd = worst_at
        failures.append(
            f"teacher-forced logits: row {b} step {i} differs by {d:.3g} from the unsharded model, bound {bd:.3g} "
            f"({ULPS} bf16 ulps of its largest logit)"
        )

    ref_tokens = ref_free["tokens"]
    tokens0 = dcp_free[0]["tokens"]
    fr: dict = {"equal_steps": [], "diverged": []}
    if any(r["tokens"] != tokens0 for r in dcp_free):
        bad = [r for r, x in enumerate(dcp_free) if x["tokens"] != tokens0]
        failures.append(f"free-running tokens differ between ranks (ranks {bad} vs rank 0)")
    for b, (want, got) in enumerate(zip(ref_tokens, tokens0)):
        first = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
        fr["equal_steps"].append(len(want) if first is None else first)
        if first is None:
            continue
        margin, bd = ref_free["margin"][b][first], bounds[b][first]
        differed = {
            layer: rows.get(b) for layer, rows in dcp_free[0]["ids_differ"].get(first, {}).items() if rows.get(b)
        }
        entry = {
            "row": b,
            "step": first,
            "margin": margin,
            "twice_bound": 2 * bd,
            "topk_ids_differed": differed,
            "reference": want[first],
            "dcp": got[first],
        }
        fr["diverged"].append(entry)
        if margin >= 2 * bd:
            failures.append(
                f"free-running tokens: row {b} step {first}: DCP chose {got[first]}, the reference {want[first]}, at a "
                f"reference margin {margin:.3g} >= twice the bound ({2 * bd:.3g}); top-k ids that differed per layer: "
                f"{differed or 'none'}"
            )
    if "collective_tokens" in dcp_free[0] and dcp_free[0]["collective_tokens"] != tokens0:
        fr["collective_differs"] = True  # (both are DCP runs; only bf16 merge order differs between backends)
    return {"ok": not failures, "failures": failures, "mechanisms": mech, "teacher_forced": tf, "free_running": fr}
