"""The indexer inputs from the model's own modules: the exact formula selects what transformers' indexer
selects; the Hadamard is orthogonal; the FP8 scores are transformers' scores within the FP8 error."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from peerdcp.integrations.transformers import tiny_config  # noqa: E402
from peerdcp.integrations.transformers.indexer import exact_scores, fp8_inputs, hadamard, index_qkw  # noqa: E402
from peerdcp.topk.reference import index_scores, index_scores_abs  # noqa: E402


def test_hadamard_is_orthogonal_and_involutive():
    x = torch.randn(5, 64)  # (the transform's math is fp32: compared at fp32 tolerances)
    y = hadamard(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(hadamard(y), x)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.zeros(3, 24))


@pytest.mark.parametrize("family,style", [("deepseek-v3.2", "neox"), ("glm-5", "interleaved")])
def test_formulas_match_the_models_indexer(family, style):
    torch.manual_seed(3)
    cfg = tiny_config(family, topk=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    attn = model.model.layers[0].self_attn
    S = 24
    x = torch.randn(1, S, cfg.hidden_size)
    pos = torch.arange(S)[None]
    pe = model.model.rotary_emb(x, position_ids=pos)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    mask = torch.ones(1, S, S, dtype=torch.bool).tril()
    with torch.no_grad():
        want = attn.indexer(x, q_resid, pe, mask, pos)  # transformers' own top-k [1, S, 8]
        q, k, w = index_qkw(attn.indexer, x, q_resid, pe, style)
    ex = exact_scores(q[0], w[0], k[0][None].expand(S, -1, -1)).masked_fill(~mask[0], float("-inf"))
    got = ex.topk(8, dim=-1).indices
    for t in range(8, S):  # rows with more than top-k keys (fp32 random scores: no ties)
        assert set(got[t].tolist()) == set(want[0, t].tolist()), t
    q8, wf, k8, ks = fp8_inputs(q[0], k[0], w[0])
    f8 = index_scores(q8, wf, k8, ks)
    err = (f8 - ex.masked_fill(~mask[0], 0.0)).abs().masked_fill(~mask[0], 0.0)
    scale = index_scores_abs(q8, wf, k8, ks).float()
    assert float((err / scale.clamp_min(1e-30)).max()) < 0.15  # e4m3: 3 mantissa bits on q and on k
