"""peerdcp.integrations.transformers: the version gate, the family check and the tiny configs (CPU, fast)."""

from __future__ import annotations

import pytest
import torch

from peerdcp.integrations.transformers import FAMILY_NAMES, check_transformers, family_of, tiny_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("version", ["5.16.2", "5.26.0", "4.57.1", "6.0.0"])
def test_unsupported_version_names_installed_and_supported(version):
    with pytest.raises(ImportError) as e:
        check_transformers(version)
    assert version in str(e.value) and ">=5.17,<5.26" in str(e.value)


@pytest.mark.parametrize("version", ["5.17.0", "5.25.0", "5.19.1"])
def test_supported_versions_pass(version):
    assert check_transformers(version) == version


def test_installed_version_is_supported():
    assert check_transformers() == transformers.__version__


def test_unsupported_family_names_the_supported_ones():
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32)
    with pytest.raises(ValueError) as e:
        family_of(cfg)
    assert "'llama'" in str(e.value) and "deepseek_v32" in str(e.value) and "glm_moe_dsa" in str(e.value)
    with pytest.raises(ValueError):
        tiny_config("llama")


@pytest.mark.parametrize("family", sorted(FAMILY_NAMES))
def test_tiny_config_builds_a_model_that_decodes(family):
    cfg = tiny_config(family)
    assert family_of(cfg) == FAMILY_NAMES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    assert family_of(model) == FAMILY_NAMES[family]
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 15)
    if family == "glm-5":
        assert cfg.indexer_types == ["full", "shared"]  # the shared top-k layer is exercised
