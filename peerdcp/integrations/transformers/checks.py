"""Each exchange checked on its own inputs, inside a model run, against peerdcp's references.

Every call of every layer (when :attr:`DCPOptions.check` is on) all-gathers what the ranks put into the exchange
(over the group's gloo twin, on the host) and recomputes what must come out:

* query: the gathered query's bytes equal :func:`peerdcp.query.reference.widened_query` of every rank's shard;
* topk: the ids equal :func:`peerdcp.topk.candidates.canonical_topk` of every rank's scores put back in global order;
* output: the merged output lies inside :func:`peerdcp.output.reference.dcp_reduce_bounds` of every rank's
  partials (the fp32 error model of the LSE merge: bf16 partials allow no exact answer), and, end to end, within
  ``ATTENTION_REL_ERR`` (norm-wise) of the unsharded attention over every rank's (selected) tokens in fp32 (the
  first ``ATTENTION_CHECK_ROWS`` rows of each call) - the
  partials are bf16, about 2^-9 relative each, so the merged output lands far inside it unless a partial is wrong.

The counts and the first failure per mechanism go into :attr:`MechanismChecks.stats`. Test-only faults
(:class:`Faults`) prove each check can fail.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...output.reference import dcp_reduce_bounds, outside_bounds
from ...query.reference import widened_query
from ...topk import reference as ref
from ...topk.candidates import canonical_topk

__all__ = ["MechanismChecks", "Faults", "FAULTS"]

FAULTS = ("none", "corrupt-partial", "corrupt-topk")
ATTENTION_REL_ERR = 1e-2
ATTENTION_CHECK_ROWS = 16


def _gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape on every rank) on the host; 16- and 8-bit floats travel as bytes (gloo
    has no bf16 or fp8)."""
    x = x.detach().cpu().contiguous()
    send = x.view(torch.uint8) if x.element_size() < 4 else x
    parts = [torch.empty_like(send) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, send, group=group)
    return [p.view(x.dtype) for p in parts]


class MechanismChecks:
    """Per-call checks of the three exchanges (no-ops unless ``enabled``).

    Args:
        group: the gloo twin of the DCP group (host tensors).
        rank, world_size, interleave: the DCP group's layout.
        rope_style, out_dtype: the query's (as given to ``QueryGather``).
        cos_sin: the rotary table the gather uses.
        topk: tokens kept per row.
        enabled: run the checks.
    """

    def __init__(
        self,
        group,
        rank: int,
        world_size: int,
        interleave: int,
        rope_style: str,
        out_dtype: torch.dtype,
        cos_sin: torch.Tensor,
        topk: int,
        enabled: bool,
    ) -> None:
        self.group, self.rank, self.W, self.I = group, rank, world_size, interleave
        self.rope_style, self.out_dtype, self.k = rope_style, out_dtype, topk
        self.cos_sin = cos_sin.detach().cpu()
        self.enabled = enabled
        self.where = ""  # set by the caller: which pass / step the next calls belong to
        self.stats: dict[str, dict] = {
            m: {"calls": 0, "bad_calls": 0, "first": None} for m in ("query", "topk", "output")
        }

    def _note(self, mech: str, bad: bool, what: str) -> None:
        st = self.stats[mech]
        st["calls"] += 1
        if bad:
            st["bad_calls"] += 1
            if st["first"] is None:
                st["first"] = f"{self.where}: {what}"

    def query(self, q_nope: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, q: torch.Tensor) -> None:
        if not self.enabled:
            return
        qn, qp = _gather(q_nope, self.group), _gather(q_pe, self.group)
        want = widened_query(
            qn, qp, positions.cpu(), self.cos_sin, rope_style=self.rope_style, out_dtype=self.out_dtype
        )
        got = q.detach().cpu()
        same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        diff = 0 if same else int((got.view(torch.uint8) != want.view(torch.uint8)).any(-1).sum())
        self._note("query", not same, f"{diff} (token, head) rows differ from widened_query")

    def topk(self, logits: torch.Tensor, lens: torch.Tensor, ids: torch.Tensor, n: int) -> None:
        """``logits [T, w]`` this rank's scores by local row, ``lens [T]`` global lengths, ``ids [T, topk]``,
        ``n`` the columns cached so far (global)."""
        if not self.enabled:
            return
        width = int(ref.local_length(n, 0, self.W, self.I))  # rank 0 holds the most rows
        x = logits.detach().float().cpu()
        x = x[:, :width] if x.shape[1] >= width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = _gather(x.contiguous(), self.group)
        full = torch.full((x.shape[0], n), float("nan"))
        for r, part in enumerate(parts):
            l_r = int(ref.local_length(n, r, self.W, self.I))
            g = ref.global_id(torch.arange(l_r), r, self.W, self.I)
            full[:, g] = part[:, :l_r]
        # (on the ids' device: the canonical merge is a Triton kernel, interpreted on CPU only under the interpreter)
        want = canonical_topk(full.to(ids.device), lens.to(ids.device), self.k).cpu()
        got = ids.detach().cpu()
        bad = ~(got == want).all(-1)
        what = ""
        if bad.any():
            t = int(bad.nonzero()[0])
            extra = sorted(set(got[t].tolist()) - set(want[t].tolist()))
            missing = sorted(set(want[t].tolist()) - set(got[t].tolist()))
            what = (
                f"{int(bad.sum())} rows differ from canonical_topk; row {t}: ids {extra[:8]} selected instead of "
                f"{missing[:8]}" + ("" if extra or missing else " (same set, another order)")
            )
        self._note("topk", bool(bad.any()), what)

    def merge(self, part: torch.Tensor, lse: torch.Tensor, merged: torch.Tensor) -> None:
        if not self.enabled:
            return
        parts, lses = _gather(part, self.group), _gather(lse.float(), self.group)
        lo, hi, _, _ = dcp_reduce_bounds(parts, lses, self.rank, lse_base="e", out_dtype=part.dtype)
        outside = int(outside_bounds(merged.detach().cpu(), lo, hi).sum())
        self._note("output", outside > 0, f"{outside} merged elements outside dcp_reduce_bounds")

    def attention(self, q, c, pe, valid, merged, heads: slice, scale: float, width: int) -> None:
        """``q [T, W*H, C + R]`` (the gathered query), this rank's ``c [T, n, C]``, ``pe [T, n, R]``, ``valid [T, n]``
        (the tokens its partial attended), ``merged [T, H, C]``; ``width`` >= every rank's ``n``."""
        if not self.enabled:
            return
        from .reference import attend_fp32

        # the first rows of the call: every rank's selected latents of a whole 256-row prefill chunk would be
        # 512 MB per rank through the host at DeepSeek-V3.2's geometry; a wrong partial shows in any row
        n_rows = min(q.shape[0], ATTENTION_CHECK_ROWS)
        q, c, pe, valid, merged = q[:n_rows], c[:n_rows], pe[:n_rows], valid[:n_rows], merged[:n_rows]
        pad = width - c.shape[1]
        c, pe = (torch.nn.functional.pad(x.detach(), (0, 0, 0, pad)) for x in (c, pe))
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
        cs, pes = _gather(c, self.group), _gather(pe, self.group)
        oks = _gather(valid.to(torch.uint8), self.group)
        dev = q.device  # (the unsharded attention of a 4096-token prefill chunk is GPU work)
        want = attend_fp32(q[:, heads].detach(), torch.cat(cs, 1).to(dev), torch.cat(pes, 1).to(dev),
                           torch.cat(oks, 1).to(dev).bool(), scale).cpu()  # fmt: skip
        got = merged.detach().float().cpu()
        rel = float((got - want).norm() / want.norm().clamp(min=1e-30))
        bad = not rel <= ATTENTION_REL_ERR
        self._note("output", bad, f"merged attention {rel:.3g} (norm-wise) from the unsharded attention over every "
                                  f"rank's tokens, above {ATTENTION_REL_ERR}")  # fmt: skip


class Faults:
    """Test-only corruptions, each of one exchange's result on one rank: ``corrupt-partial`` (rank W-1's partial
    output scaled before the merge), ``corrupt-topk`` (one id of rank 0's selection replaced)."""

    def __init__(self, fault: str, rank: int, world_size: int) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.fault, self.rank, self.W = fault, rank, world_size

    def partial(self, part: torch.Tensor) -> torch.Tensor:
        if self.fault == "corrupt-partial" and self.rank == self.W - 1:
            return (part.float() * 1.5 + 0.25).to(part.dtype)
        return part

    def topk(self, ids: torch.Tensor, qcol: torch.Tensor) -> torch.Tensor:
        if self.fault == "corrupt-topk" and self.rank == 0 and ids.shape[0]:
            ids = ids.clone()
            t = int(qcol.argmax())  # the longest row: a selection with the most candidates
            ids[t, 0] = (ids[t, 0] + 1) % (int(qcol[t]) + 1)
        return ids
