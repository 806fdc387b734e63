"""A transformers model decoding through peerdcp on CPU rank processes, checked against the same model unsharded.

The matrix is every family at W = 2 and 3, interleave 1 and W, and for the DSA families the FP8 indexer and the
model's exact fp32 formula: the whole product at W = 2 and every pair of those at W = 3 (16 cases), each decoding 16
tokens that must pass the whole verdict, with every exchange called and exact on its own inputs. The prompts are 11
tokens long (not a multiple of W*I in any case), and six of the W = 2 cases decode a batch of two prompts of
different lengths (11 and 9); the rest decode one prompt, which halves a case's time (three ranks spinning on two
cores under the interpreter make W = 3 the costliest). ``peerdcp generate`` itself runs at
its default, with a prompt shorter than top-k that crosses it mid-decode, and with each test-only fault (non-zero
exit naming the mechanism).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from peerdcp.harness.launch import RankPool  # noqa: E402
from peerdcp.integrations.transformers import decode  # noqa: E402
from peerdcp.integrations.transformers.verdict import verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# the batch-of-two cases (family, W, interleave, indexer); every other case of the product decodes one prompt
BATCH_OF_TWO = {
    ("deepseek-v3.2", 2, 1, "fp8"),
    ("deepseek-v3.2", 2, 2, "exact"),
    ("glm-5", 2, 1, "exact"),
    ("glm-5", 2, 2, "fp8"),
    ("deepseek-v3", 2, 1, "fp8"),
    ("deepseek-v3", 2, 2, "fp8"),
}
# W = 3 (three ranks on two cores: the costliest cases) takes, per DSA family, one indexer per interleave so that
# every pair of family, interleave and indexer still occurs at W = 3 (4 cases instead of 8)
W3_DSA = {
    ("deepseek-v3.2", 1, "fp8"),
    ("deepseek-v3.2", 3, "exact"),
    ("glm-5", 1, "exact"),
    ("glm-5", 3, "fp8"),
}
CASES = [
    (family, W, interleave, indexer)
    for family in ("deepseek-v3.2", "glm-5", "deepseek-v3")
    for W in (2, 3)
    for interleave in (1, W)
    for indexer in (("fp8", "exact") if family != "deepseek-v3" else ("fp8",))  # MLA has no indexer
    if W == 2 or family == "deepseek-v3" or (family, interleave, indexer) in W3_DSA
]


@pytest.fixture(scope="module")
def pools():
    made: dict[int, RankPool] = {}

    def get(W: int) -> RankPool:
        if W not in made or made[W].broken:
            made[W] = RankPool(W)
        return made[W]

    yield get
    for p in made.values():
        p.close()


def _args(family: str, interleave: int, indexer: str, **kw) -> dict:
    a = dict(
        family=family,
        seed=2026,
        dtype="bf16",
        batch=2,
        prompt_len=11,
        new_tokens=16,
        chunk=256,
        interleave=interleave,
        indexer=indexer,
        query="bf16",
        memory="auto",
        timeout_s=60.0,
        fault="none",
        timing=False,
        backends={"query": "auto", "topk": "auto", "output": "auto"},
    )
    a.update(kw)
    return a


def _decode(pool: RankPool, args: dict) -> dict:
    r = decode.run_phases(pool, args)
    ref = r["reference_free"][0]
    return dict(
        setup=r["setup"][0],
        ref=ref,
        verdict=verdict(ref, r["dcp_forced"], r["reference_forced"][0], r["dcp_free"]),
        forced=r["dcp_forced"],
        free=r["dcp_free"],
        cap=r["capacity"],
    )


@pytest.mark.parametrize("family,W,interleave,indexer", CASES)
def test_decode_matches_the_unsharded_model(pools, family, W, interleave, indexer):
    batch = 2 if (family, W, interleave, indexer) in BATCH_OF_TWO else 1
    res = _decode(pools(W), _args(family, interleave, indexer, batch=batch))
    v = res["verdict"]
    assert v["ok"], v["failures"]
    assert len(res["ref"]["tokens"]) == batch and all(len(t) == 16 for t in res["ref"]["tokens"])
    assert res["setup"]["prompt_lens"] == [11, 9][:batch]
    dsa = family != "deepseek-v3"
    for name in ("query", "output") + (("topk",) if dsa else ()):
        m = v["mechanisms"][name]
        assert m["calls"] > 0 and m["bad_calls"] == 0, (name, m)
    assert v["teacher_forced"]["worst_ratio"] <= 1.0
    for mech in ("query", "output") + (("topk",) if dsa else ()):
        assert res["setup"]["mechanisms"][mech]["backend"] == "direct"
    assert sum(c["local_columns"] for c in res["cap"]) == res["cap"][0]["columns"]
    for c in res["cap"]:  # each rank holds exactly its owned columns
        assert c["kv_bytes_local"] * c["columns"] == c["kv_bytes_replicated"] * c["local_columns"]
        if dsa:
            assert c["index_k_bytes_local"] * c["columns"] == c["index_k_bytes_replicated"] * c["local_columns"]


def test_short_prompt_crosses_topk_mid_decode(pools):
    # prompts of 5 and 4 tokens against top-8: the first steps select every token, later ones must choose
    res = _decode(pools(2), _args("glm-5", 1, "fp8", prompt_len=5, query="fp8"))
    assert res["verdict"]["ok"], res["verdict"]["failures"]
    assert res["setup"]["prompt_lens"] == [5, 4] and res["setup"]["topk"] == 8


def test_an_adopted_greedy_run_is_the_teacher_forced_run(pools):
    # run_phases skips the teacher-forced decode when the checked greedy tokens equal the reference's; decoding
    # teacher-forced anyway must give the same logits bit for bit and the same top-k ids at every call
    from on_ranks import generate as fns

    pool = pools(2)
    args = _args("deepseek-v3.2", 1, "fp8", batch=2, new_tokens=6)
    pool.run(decode.setup, args)
    try:
        ref = pool.run(decode.reference_free)[0]
        free = pool.run(decode.dcp_free, True)
        assert all(r["tokens"] == ref["tokens"] for r in free), "seed gives a near tie: pick another"
        adopted = pool.run(decode.adopt_free_as_forced)
        assert all(a["from"] == "greedy decode" and a["checks"]["topk"]["calls"] > 0 for a in adopted)
        for r in pool.run(fns.forced_matches_adopted):
            assert r["logits_equal"] and r["ids_equal"] and r["calls"] == 6, r  # prefill + 5 decode steps
    finally:
        pool.run(decode.teardown)


class _FakePool:
    """Answers the phases with canned per-rank results and records which ran (the driver's branching only)."""

    def __init__(self, free_tokens: list[list[list[int]]]) -> None:
        self.free_tokens, self.ran = free_tokens, []
        self.broken = False

    def run(self, fn, *a, timeout=None):
        self.ran.append((fn.__name__, a))
        if fn is decode.reference_free:
            return [{"tokens": [[1, 2, 3]], "margin": [[1.0, 1.0, 1.0]]}] * 2
        if fn is decode.dcp_free:
            return [{"tokens": t} for t in self.free_tokens]
        return [{"from": fn.__name__}] * 2


@pytest.mark.parametrize(
    "timing,free_tokens,want",
    [
        (False, [[[1, 2, 3]], [[1, 2, 3]]], ["dcp_free", "adopt_free_as_forced", "reference_forced"]),
        (False, [[[1, 2, 3]], [[1, 2, 4]]], ["dcp_free", "dcp_forced", "reference_forced"]),  # one rank parts
        (False, [[[1, 2, 4]], [[1, 2, 4]]], ["dcp_free", "dcp_forced", "reference_forced"]),
        (True, [[[1, 2, 3]], [[1, 2, 3]]], ["dcp_forced", "reference_forced", "dcp_free"]),  # timed: never adopted
    ],
)
def test_run_phases_adopts_only_when_every_rank_decoded_the_reference_tokens(timing, free_tokens, want):
    pool, shown = _FakePool(free_tokens), []
    out = decode.run_phases(pool, {"timing": timing}, shown.append)
    assert len(shown) == decode.PHASES == len(pool.ran)  # the progress display's total
    names = [n for n, _ in pool.ran]
    assert names[:2] == ["setup", "reference_free"] and names[-2:] == ["capacity", "teardown"]
    assert names[2:-2] == want
    assert [a for n, a in pool.ran if n == "dcp_free"] == [() if timing else (True,)]  # checked only untimed
    assert set(out) == {"setup", "reference_free", "dcp_forced", "reference_forced", "dcp_free", "capacity"}


def test_run_phases_frees_the_ranks_when_a_phase_fails():
    class Failing(_FakePool):
        def run(self, fn, *a, timeout=None):
            if fn is decode.reference_forced:
                raise RuntimeError("rank 1 failed")
            return super().run(fn, *a, timeout=timeout)

    pool = Failing([[[1, 2, 3]], [[1, 2, 3]]])
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        decode.run_phases(pool, {"timing": False})
    assert pool.ran[-1][0] == "teardown"


NEWEST = REPO / ".tf-newest"  # transformers 5.25, the newest supported (scripts/setup.sh test)


def _cli(tmp_path, *args: str, newest: bool = False) -> tuple[int, str, dict | None]:
    out = tmp_path / "report.json"
    env = dict(os.environ)
    if newest:
        env["PYTHONPATH"] = os.pathsep.join([str(NEWEST), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", "peerdcp", "generate", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=env,
    )
    return p.returncode, p.stdout + p.stderr, json.loads(out.read_text()) if out.exists() else None


def test_generate_default_passes_on_the_newest_transformers(tmp_path):
    # the matrix above runs the oldest supported transformers (5.17, the venv's); the main job runs the newest
    assert (NEWEST / "transformers").is_dir(), "scripts/setup.sh test installs transformers 5.25 into .tf-newest"
    rc, text, rep = _cli(tmp_path, newest=True)
    assert rc == 0, text
    assert rep["setup"][0]["transformers"] == "5.25.0"
    assert "verdict: PASS" in text and "not a performance figure" in text
    assert rep["verdict"]["ok"] and rep["world"] == 2
    assert rep["dcp_free"][0]["ms_per_token"] > 0 and rep["dcp_free"][0]["collective_ms_per_token"] > 0
    assert set(rep["setup"][0]["collective"]) >= {"query", "output", "topk"}


@pytest.mark.parametrize("fault,mechanism", [("corrupt-partial", "output"), ("corrupt-topk", "topk")])
def test_a_wrong_exchange_fails_naming_its_mechanism(tmp_path, fault, mechanism):
    rc, text, rep = _cli(tmp_path, "--fault", fault, "--no-timing", "--new-tokens", "4", "--batch", "1")
    assert rc == 1, text
    assert f"FAIL {mechanism}: " in text
    assert any(f.startswith(f"{mechanism}:") for f in rep["verdict"]["failures"])


def test_usage_errors_exit_2(tmp_path):
    rc, text, _ = _cli(tmp_path, "--override", "nonsense")
    assert rc == 2 and "KEY=VALUE" in text


def test_attention_size_builds_the_real_attention_geometry():
    from peerdcp.cli import build_parser

    args = build_parser().parse_args(["generate", "--size", "attention"])
    assert args.size == "attention"
    m = decode._build("deepseek-v3.2", "attention", None, None, 0, {"num_hidden_layers": 1, "hidden_size": 256})
    c = m.config
    assert (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim) == (128, 512, 64)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 2048)
    assert m.model.layers[0].self_attn.q_b_proj.weight.shape == (128 * 192, 1536)


def test_config_and_weights_from_a_local_folder(tmp_path):
    # a user's config.json + safetensors: the tiny GLM-5 saved by transformers, decoded from the folder
    import torch
    import transformers

    from peerdcp.integrations.transformers import tiny_config

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("glm-5"))
    model.save_pretrained(tmp_path / "m")
    rc, text, rep = _cli(tmp_path, "--config", str(tmp_path / "m"), "--weights", str(tmp_path / "m"), "--batch", "1",
                         "--new-tokens", "4", "--no-timing")  # fmt: skip
    assert rc == 0, text
    assert rep["setup"][0]["family"] == "glm_moe_dsa" and rep["verdict"]["ok"]
    built = decode._build("glm-5", "tiny", str(tmp_path / "m"), str(tmp_path / "m"), 0, {})
    for (name, p), q in zip(model.state_dict().items(), built.state_dict().values()):
        assert torch.equal(p, q), name  # the folder's weights, not the seed's


def _phases(ref_tokens, dcp_tokens, margin, diff=0.001, max_abs=0.5, ranks=2):
    ref = {"tokens": [ref_tokens], "margin": [margin]}
    forced = [{"checks": {"query": {"calls": 2, "bad_calls": 0, "first": None}}}] * ranks
    ref_forced = {"max_diff": [[diff] * len(ref_tokens)], "max_abs": [[max_abs] * len(ref_tokens)]}
    free = [{"tokens": [dcp_tokens], "ids_differ": {}} for _ in range(ranks)]
    return ref, forced, ref_forced, free


def test_verdict_is_margin_aware():
    bound = 8 * 2.0**-8  # 8 bf16 ulps of a largest logit in [0.5, 1)
    # parting at a near tie (margin below twice the bound) passes; at a clear margin it fails, naming the step
    assert verdict(*_phases([1, 2, 3], [1, 2, 4], [1.0, 1.0, 2 * bound * 0.9]))["ok"]
    v = verdict(*_phases([1, 2, 3], [1, 5, 3], [1.0, 2 * bound * 1.1, 1.0]))
    assert not v["ok"] and "step 1" in v["failures"][0]
    # teacher-forced logits past the bound fail
    v = verdict(*_phases([1, 2], [1, 2], [1.0, 1.0], diff=bound * 1.01))
    assert not v["ok"] and v["failures"][0].startswith("teacher-forced logits")
    # ranks that disagree fail
    ref, forced, rf, free = _phases([1, 2], [1, 2], [1.0, 1.0])
    free[1] = {"tokens": [[1, 3]], "ids_differ": {}}
    assert any("differ between ranks" in f for f in verdict(ref, forced, rf, free)["failures"])
