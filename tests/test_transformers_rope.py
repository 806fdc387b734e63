"""rope_table: peerdcp's RoPE over the model's table gives transformers' rotation (query-key dot products
for the interleaved MLA RoPE, whose output layout transformers permutes; the same values for NeoX)."""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from peerdcp.integrations.transformers import tiny_config  # noqa: E402
from peerdcp.integrations.transformers.rope import rope_table  # noqa: E402
from peerdcp.query.reference import apply_rope  # noqa: E402


@pytest.mark.parametrize("family", ["deepseek-v3.2", "glm-5"])
def test_table_rotates_as_transformers_does(family):
    torch.manual_seed(1)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    cfg = tiny_config(family, rope_parameters=yarn if family == "deepseek-v3.2" else None)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    mod = sys.modules[type(model).__module__]
    P, d = 300, cfg.qk_rope_head_dim
    table = rope_table(model, P)
    assert table.shape == (P, d) and table.dtype == torch.float32
    pos = torch.randint(0, P, (1, 17))
    cos, sin = model.model.rotary_emb(torch.zeros(1), position_ids=pos)
    q, k = torch.randn(1, 1, 17, d, dtype=torch.float64), torch.randn(1, 1, 17, d, dtype=torch.float64)
    rows = table[pos[0]].double()
    # interleaved (the MLA q_pe / k_pe): transformers returns evens-then-odds; dot products are layout-free
    hq, hk = mod.apply_rotary_pos_emb_interleave(q, k, cos.double(), sin.double())
    pq, pk = (apply_rope(x[0, 0], rows, "interleaved", dtype=torch.float64) for x in (q, k))
    torch.testing.assert_close((pq * pk).sum(-1), (hq[0, 0] * hk[0, 0]).sum(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pq[:, 0::2], hq[0, 0, :, : d // 2], rtol=1e-6, atol=1e-6)
    if family == "deepseek-v3.2":  # the NeoX indexer RoPE: the same layout, the same values
        nq, _ = mod.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        torch.testing.assert_close(apply_rope(q[0, 0], rows, "neox", dtype=torch.float64), nq[0, 0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_positions"):
        rope_table(torch.nn.Linear(1, 1), 0)
    with pytest.raises(TypeError, match="rotary_emb"):
        rope_table(torch.nn.Linear(1, 1), 4)
