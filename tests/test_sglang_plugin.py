"""CPU tests of the SGLang plugin against the real sglang 0.5.23 package (installed by scripts/setup_sglang.sh).

Covers: discovery through the entry point and SGLang's own ``load_plugins()``; SGLang's own parser accepting
the new flags and rejecting every invalid combination with the plugin's message; the values reaching a
spawned worker; every hook target resolving in the installed version (and a missing one failing loudly);
the resolution step; SGLang's own merge / query functions routed to peerdcp across two real processes
(gloo, TRITON_INTERPRET=1, host memory via the test-only ``PEERDCP_SGLANG_MEMORY=host``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

try:
    import sglang  # noqa: F401

    HAVE_SGLANG = True
except Exception:  # noqa: BLE001
    HAVE_SGLANG = False

if not HAVE_SGLANG:
    if os.environ.get("CI"):
        raise RuntimeError("sglang is not importable in CI: scripts/setup_sglang.sh did not run or failed")
    pytest.skip("sglang 0.5.23 not installed (bash scripts/setup_sglang.sh)", allow_module_level=True)

from on_ranks import sglang as R  # noqa: E402

import peerdcp.integrations.sglang as plugin  # noqa: E402
from peerdcp.integrations.sglang import options as O  # noqa: E402
from peerdcp.integrations.sglang import targets as TG  # noqa: E402

ENV_KEYS = [*O.ENV.values(), O.ENV_ASSUME_CUDA, O.ENV_MEMORY]


@pytest.fixture(scope="module")
def loaded():
    """SGLang's own plugin loading in this process (hooks stay applied for the module's tests)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert plugin._REGISTERED, "load_plugins() did not run peerdcp's register()"
    return plugin


@pytest.fixture
def clean_env(monkeypatch):
    """No PEERDCP_SGLANG_* variables; afterwards exactly the previous ones (the plugin exports into os.environ)."""
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    O.reset()
    yield monkeypatch
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    O.reset()


def _model_dir(tmp_path, **cfg):
    d = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV32ForCausalLM"], **cfg}))
    return str(d)


def _parse(argv):
    """SGLang's own CLI path: ``prepare_server_args`` (parser + from_cli_args)."""
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(argv)


# --- discovery -------------------------------------------------------------------------------------------------
def test_entry_point_discovered():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "peerdcp"]
    assert len(eps) == 1, eps
    assert eps[0].value == "peerdcp.integrations.sglang:register"
    assert eps[0].load() is plugin.register


_CHILD = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, sys, warnings
    warnings.simplefilter("ignore")

    def worker(q):
        # what an SGLang scheduler process does first
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import peerdcp.integrations.sglang as p
        q.put({"opts": p.current().__dict__, "errors": p.load_errors()})

    if __name__ == "__main__":
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import peerdcp.integrations.sglang as p
        from sglang.srt.layers import dcp
        from sglang.srt.server_args import prepare_server_args
        sa = prepare_server_args(sys.argv[1:])
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=worker, args=(q,))
        proc.start()
        child = q.get(timeout=120)
        proc.join(60)
        print(json.dumps({
            "errors": p.load_errors(),
            "record_comm": sa.dcp_comm_backend,
            "record_has_query_field": hasattr(sa, "dcp_query_backend"),
            "merge_wrapped": hasattr(dcp.cp_lse_ag_out_rs_mla, "__wrapped__"),
            "a2a_wrapped": hasattr(dcp.dcp_a2a_lse_reduce, "__wrapped__"),
            "child": child,
        }))
    """
)


def test_load_plugins_and_values_reach_spawned_worker(tmp_path, clean_env):
    """A fresh process: SGLang's load_plugins() runs register; the parsed flags reach a spawned worker."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env[O.ENV_ASSUME_CUDA] = "1"
    argv = ["--model-path", _model_dir(tmp_path, index_topk=2048), "--tp-size", "2", "--dcp-size", "2"]
    argv += ["--dcp-comm-backend", "symm_a2a", "--dcp-query-backend", "vmm_direct"]
    argv += ["--dcp-indexer-backend", "owner_sharded", "--dcp-topk-backend", "vmm", "--dcp-peer-fallback", "a2a"]
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), *argv], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["errors"] == []
    assert res["record_comm"] == "symm_a2a"
    assert not res["record_has_query_field"]  # SGLang's record drops it: the env carries it
    assert res["merge_wrapped"] and res["a2a_wrapped"]  # the re-exported bindings forward_mla imports
    assert res["child"]["errors"] == []
    assert res["child"]["opts"] == {
        "comm_backend": "symm_a2a",
        "query_backend": "vmm_direct",
        "indexer_backend": "owner_sharded",
        "topk_backend": "vmm",
        "peer_fallback": "a2a",
    }


# --- the parser -----------------------------------------------------------------------------------------------------
def test_parser_has_flags_and_defaults(loaded, clean_env, tmp_path):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    acts = parser._option_string_actions
    assert {"a2a", "ag_rs", "fi_a2a", "vmm", "symm_a2a"} <= set(acts["--dcp-comm-backend"].choices)
    assert list(acts["--dcp-query-backend"].choices) == ["allgather", "vmm_direct"]
    assert list(acts["--dcp-indexer-backend"].choices) == ["replicated", "owner_sharded"]
    assert list(acts["--dcp-topk-backend"].choices) == ["allgather", "vmm"]
    assert list(acts["--dcp-peer-fallback"].choices) == ["error", "a2a"]
    ns = parser.parse_args(["--model-path", "m"])
    assert (ns.dcp_query_backend, ns.dcp_indexer_backend, ns.dcp_topk_backend, ns.dcp_peer_fallback) == (
        "allgather",
        "replicated",
        "allgather",
        "error",
    )
    # Defaults with nothing else: valid, nothing exported as a peer route.
    sa = _parse(["--model-path", "m"])
    assert sa.dcp_comm_backend is None
    assert O.current().peer_routes() == []
    # SGLang's field metadata is not mutated (a fresh list goes to each parser's action): no duplicates
    ServerArgs.add_cli_args(argparse.ArgumentParser())
    p2 = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p2)
    ch = list(p2._option_string_actions["--dcp-comm-backend"].choices)
    assert ch.count("vmm") == 1 and ch.count("symm_a2a") == 1


ACCEPTED = [
    (["--dcp-comm-backend", "vmm"], {"comm_backend": "vmm"}),
    (["--dcp-comm-backend", "symm_a2a"], {"comm_backend": "symm_a2a"}),
    (["--dcp-query-backend", "vmm_direct"], {"query_backend": "vmm_direct"}),
    (["--dcp-query-backend", "vmm_direct", "--no-dcp-replicate-q-proj"], {"query_backend": "vmm_direct"}),
    (["--dcp-indexer-backend", "owner_sharded"], {"indexer_backend": "owner_sharded"}),
    (
        ["--dcp-indexer-backend", "owner_sharded", "--dcp-topk-backend", "vmm"],
        {"indexer_backend": "owner_sharded", "topk_backend": "vmm"},
    ),
    (["--dcp-comm-backend", "vmm", "--enable-two-batch-overlap"], {"comm_backend": "vmm"}),
    (["--dcp-comm-backend", "a2a", "--dcp-peer-fallback", "a2a"], {"comm_backend": "a2a", "peer_fallback": "a2a"}),
    (
        ["--dcp-comm-backend", "vmm", "--dcp-query-backend", "vmm_direct", "--dcp-indexer-backend", "owner_sharded"]
        + ["--dcp-topk-backend", "vmm", "--dcp-peer-fallback", "a2a"],
        {
            "comm_backend": "vmm",
            "query_backend": "vmm_direct",
            "indexer_backend": "owner_sharded",
            "topk_backend": "vmm",
            "peer_fallback": "a2a",
        },
    ),
]


@pytest.mark.parametrize("extra,expect", ACCEPTED, ids=lambda x: "-".join(x) if isinstance(x, list) else None)
def test_parser_accepts(loaded, clean_env, tmp_path, extra, expect):
    clean_env.setenv(O.ENV_ASSUME_CUDA, "1")
    model = _model_dir(tmp_path, index_topk=2048)
    sa = _parse(["--model-path", model, "--tp-size", "2", "--dcp-size", "2", *extra])
    want = {**O.Options().__dict__, **expect}
    assert O.current().__dict__ == want
    assert sa.dcp_comm_backend == want["comm_backend"]
    for name, key in O.ENV.items():
        assert os.environ.get(key, None) == (None if want[name] is None else want[name])
    if want["query_backend"] == "vmm_direct":
        assert sa.dcp_replicate_q_proj is False  # pinned so SGLang's DSA override cannot turn it on


def _rejected(argv, capsys=None):
    with pytest.raises(ValueError) as ei:
        _parse(argv)
    msg = str(ei.value)
    assert msg.startswith("peerdcp SGLang plugin: invalid DCP configuration"), msg
    return msg


PEER_ROUTES = [
    ["--dcp-comm-backend", "vmm"],
    ["--dcp-comm-backend", "symm_a2a"],
    ["--dcp-query-backend", "vmm_direct"],
    ["--dcp-indexer-backend", "owner_sharded"],
    ["--dcp-indexer-backend", "owner_sharded", "--dcp-topk-backend", "vmm"],
]


@pytest.mark.parametrize("route", PEER_ROUTES, ids=lambda r: "-".join(r))
def test_rejects_peer_route_without_dcp_or_cuda(loaded, clean_env, tmp_path, route):
    model = _model_dir(tmp_path, index_topk=2048)
    clean_env.setenv(O.ENV_ASSUME_CUDA, "1")
    msg = _rejected(["--model-path", model, "--dcp-size", "1", *route])
    assert "need(s) --dcp-size > 1 (got --dcp-size 1)" in msg and " ".join(route[-2:]) in msg
    clean_env.setenv(O.ENV_ASSUME_CUDA, "0")
    msg = _rejected(["--model-path", model, "--tp-size", "2", "--dcp-size", "2", *route])
    assert "need(s) CUDA" in msg and "need(s) --dcp-size" not in msg
    # the real check (no override): this machine has no CUDA; --device cpu is named
    clean_env.delenv(O.ENV_ASSUME_CUDA)
    msg = _rejected(["--model-path", model, "--tp-size", "2", "--dcp-size", "2", "--device", "cpu", *route])
    assert "need(s) CUDA (--device cpu)" in msg
    if not torch.cuda.is_available():
        msg = _rejected(["--model-path", model, "--tp-size", "2", "--dcp-size", "2", *route])
        assert "torch.cuda.is_available() is False" in msg


def test_rejects_invalid_combinations(loaded, clean_env, tmp_path):
    clean_env.setenv(O.ENV_ASSUME_CUDA, "1")
    base = ["--tp-size", "2", "--dcp-size", "2"]
    dsa = _model_dir(tmp_path, index_topk=2048)
    msg = _rejected(["--model-path", dsa, *base, "--dcp-topk-backend", "vmm"])
    assert "--dcp-topk-backend vmm needs --dcp-indexer-backend owner_sharded" in msg
    small = _model_dir(tmp_path, index_topk=256)
    msg = _rejected(
        ["--model-path", small, *base, "--dcp-indexer-backend", "owner_sharded", "--dcp-topk-backend", "vmm"]
    )
    assert "--dcp-topk-backend vmm needs index_topk 2048, the model has 256" in msg
    # index_topk overridden to 2048 through SGLang's --json-model-override-args: accepted
    _parse(
        ["--model-path", small, *base, "--dcp-indexer-backend", "owner_sharded", "--dcp-topk-backend", "vmm"]
        + ["--json-model-override-args", '{"index_topk": 2048}']
    )
    dense = _model_dir(tmp_path)  # no index_topk: not a DSA model
    msg = _rejected(["--model-path", dense, *base, "--dcp-indexer-backend", "owner_sharded"])
    assert "need(s) a DSA model (index_topk in its config)" in msg
    msg = _rejected(["--model-path", dsa, *base, "--dcp-query-backend", "vmm_direct", "--dcp-replicate-q-proj"])
    assert "--dcp-query-backend vmm_direct conflicts with --dcp-replicate-q-proj" in msg
    msg = _rejected(["--model-path", dsa, *base, "--dcp-comm-backend", "symm_a2a", "--enable-two-batch-overlap"])
    assert "--dcp-comm-backend symm_a2a does not support --enable-two-batch-overlap" in msg
    # every problem is listed in one error, and a rejected parse exports nothing
    for k in O.ENV.values():
        os.environ.pop(k, None)
    msg = _rejected(
        ["--model-path", small, "--dcp-size", "1", "--dcp-comm-backend", "symm_a2a", "--enable-two-batch-overlap"]
        + ["--dcp-topk-backend", "vmm", "--dcp-query-backend", "vmm_direct", "--dcp-replicate-q-proj"]
    )
    assert msg.count("\n  - ") == 5, msg
    # nothing was exported by a rejected parse
    assert os.environ.get(O.ENV["topk_backend"]) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--dcp-comm-backend", "nccl"],
        ["--dcp-query-backend", "direct"],
        ["--dcp-indexer-backend", "sharded"],
        ["--dcp-topk-backend", "allgather2"],
        ["--dcp-peer-fallback", "ag_rs"],
    ],
    ids=lambda a: a[0],
)
def test_argparse_rejects_unknown_values(loaded, clean_env, capsys, argv):
    with pytest.raises(SystemExit) as ei:
        _parse(["--model-path", "m", *argv])
    assert ei.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# --- hook targets ---------------------------------------------------------------------------------------------------
def test_every_hook_target_resolves(loaded):
    assert TG.sglang_version() == TG.SUPPORTED_SGLANG
    res = TG.verify_all()
    assert res == {name: "ok" for name in TG.TARGETS}, res
    assert plugin.load_errors() == []
    # eager targets are wrapped in place (HookRegistry), with SGLang's original kept as __wrapped__
    for name in ("dcp_a2a_lse_reduce", "cp_lse_ag_out_rs_mla", "all_gather_q_for_mla_decode", "shutdown"):
        owner, attr, value = TG.resolve(TG.TARGETS[name])
        assert getattr(value, "__wrapped__", None) is plugin._ORIGINALS[name], name
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS

    assert plugin._resolution_step in _HOOKS["handle_decode_context_parallelism"]
    # the heavy runner module was not imported by load_plugins; its hook waits for SGLang to import it
    if "sglang.srt.model_executor.runner.base_runner" not in sys.modules:
        assert "sglang.srt.model_executor.runner.base_runner" in TG._PENDING


@pytest.mark.parametrize(
    "target",
    [
        TG.Target("sglang.srt.layers.dcp.comm", "dcp_a2a_lse_reduce_v2", why="renamed merge"),
        TG.Target("sglang.srt.server_args", "ServerArgs.add_cli_args_v2", why="renamed method"),
        TG.Target("sglang.srt.layers.dcp.nonexistent", "f", why="moved module"),
        TG.Target("sglang.srt.model_executor.runner.base_runner", "BaseRunner._pre_init_ws", lazy=True, why="lazy"),
        TG.Target("sglang.srt.model_executor.runner.gone", "BaseRunner.x", lazy=True, why="lazy module"),
    ],
    ids=lambda t: t.dotted,
)
def test_missing_target_fails_loudly(target):
    with pytest.raises(TG.HookTargetError) as ei:
        TG.verify(target)
    msg = str(ei.value)
    assert target.dotted in msg and f"sglang {TG.sglang_version()}" in msg and "0.5.23" in msg


_MISSING_CHILD = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    from peerdcp.integrations.sglang import targets as TG
    # what a future SGLang without this method looks like to the plugin
    TG.TARGETS["pre_capture"] = TG.Target(
        "sglang.srt.model_executor.runner.base_runner", "BaseRunner.nope", lazy=True, why="pre-capture"
    )
    from sglang.srt.plugins import load_plugins
    load_plugins()  # SGLang logs the plugin's HookTargetError with its traceback and goes on
    import peerdcp.integrations.sglang as p
    from sglang.srt.server_args import prepare_server_args
    out = {"errors": p.load_errors()}
    base = ["--model-path", "m", "--tp-size", "2", "--dcp-size", "2"]
    try:
        prepare_server_args(base + ["--dcp-comm-backend", "vmm"])
        out["vmm"] = "accepted"
    except ValueError as e:
        out["vmm"] = str(e)
    prepare_server_args(base + ["--dcp-comm-backend", "a2a"])  # no peer route: SGLang's own path still works
    print(json.dumps(out))
    """
)


def test_missing_target_at_load_fails_loudly(tmp_path, clean_env):
    """A missing target: load_plugins logs register's error naming it, and a peer route is then refused."""
    script = tmp_path / "missing.py"
    script.write_text(_MISSING_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env[O.ENV_ASSUME_CUDA] = "1"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to execute general plugin: peerdcp" in out.stderr and "BaseRunner.nope" in out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res["errors"]) == 1 and "BaseRunner.nope" in res["errors"][0]
    assert "sglang 0.5.23" in res["errors"][0]
    assert res["vmm"].startswith("peerdcp SGLang plugin: invalid DCP configuration") and "BaseRunner.nope" in res["vmm"]


_DIRECT_CHILD = textwrap.dedent(
    """
    import json
    from sglang.srt.layers.dcp import comm
    from sglang.srt.plugins import load_plugins
    import peerdcp.integrations.sglang as plugin

    before = id(comm.dcp_a2a_lse_reduce)  # an id: SGLang re-binds module globals that hold the original
    load_plugins()  # SGLANG_PLUGINS names no peerdcp: the entry point is skipped, nothing is applied
    skipped = not plugin._REGISTERED and id(comm.dcp_a2a_lse_reduce) == before
    plugin.register()  # by hand, as on a machine where peerdcp is only on PYTHONPATH
    print(json.dumps({"skipped": skipped, "hooked": id(comm.dcp_a2a_lse_reduce) != before}))
    """
)


def test_register_by_hand_applies_hooks(tmp_path, clean_env):
    """Without the entry point (peerdcp importable, not installed), calling ``register()`` after SGLang's
    ``load_plugins()`` must still hook SGLang's functions (load_plugins' one apply step has passed)."""
    script = tmp_path / "direct.py"
    script.write_text(_DIRECT_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["SGLANG_PLUGINS"] = "not_peerdcp"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"skipped": True, "hooked": True}


def test_patch_when_imported(tmp_path, monkeypatch):
    """The lazy hook mechanism: the patch runs right after the module is first imported."""
    pkg = tmp_path / "peerdcp_fake_mod_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runner.py").write_text("class Runner:\n    def step(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def apply(owner, attr):
        orig = getattr(owner, attr)
        calls.append(attr)
        setattr(owner, attr, lambda self: orig(self) + 10)

    t = TG.Target("peerdcp_fake_mod_pkg.runner", "Runner.step", lazy=True)
    TG.patch_when_imported(t, apply)
    assert calls == [] and TG._FINDER in sys.meta_path
    import peerdcp_fake_mod_pkg.runner as m

    assert calls == ["step"] and m.Runner().step() == 11
    assert "peerdcp_fake_mod_pkg.runner" not in TG._PENDING
    # a target missing at import time raises when the module loads
    (pkg / "other.py").write_text("class Runner:\n    pass\n")
    TG.patch_when_imported(TG.Target("peerdcp_fake_mod_pkg.other", "Runner.step", lazy=True), apply)
    with pytest.raises(TG.HookTargetError, match="Runner.step"):
        import peerdcp_fake_mod_pkg.other  # noqa: F401
    TG._PENDING.pop("peerdcp_fake_mod_pkg.other", None)


# --- the resolution step (Engine API path, model config) ----------------------------------------------------------
def _record(**kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="m", tp_size=2, **kw)


def test_resolution_step(loaded, clean_env, monkeypatch):
    clean_env.setenv(O.ENV_ASSUME_CUDA, "1")
    calls = []
    prev = lambda sa: calls.append(sa)  # noqa: E731 - SGLang's step
    # Engine(dcp_comm_backend="vmm", ...) + env for the query flag: validated, exported, previous step runs
    monkeypatch.setenv(O.ENV["query_backend"], "vmm_direct")
    sa = _record(dcp_size=2, dcp_comm_backend="vmm")
    plugin._resolution_step(sa, prev)
    assert calls == [sa]
    assert os.environ[O.ENV["comm_backend"]] == "vmm"
    assert ("peerdcp --dcp-query-backend vmm_direct", {"dcp_replicate_q_proj": False}) in sa._resolved_overrides
    # invalid on the resolved record: plugin message, SGLang's step not reached
    calls.clear()
    with pytest.raises(ValueError, match=r"need\(s\) --dcp-size > 1"):
        plugin._resolution_step(_record(dcp_size=1, dcp_comm_backend="symm_a2a"), prev)
    with pytest.raises(ValueError, match="does not support --enable-two-batch-overlap"):
        plugin._resolution_step(_record(dcp_size=2, dcp_comm_backend="symm_a2a", enable_two_batch_overlap=True), prev)
    assert calls == []
    # index_topk from the model's HF config (SGLang's ModelConfig)
    import types

    from sglang.srt.arg_groups import overrides

    for topk, ok in ((2048, True), (256, False), (None, False)):
        cfg = types.SimpleNamespace(hf_config=types.SimpleNamespace(index_topk=topk))
        monkeypatch.setattr(overrides, "model_config_of", lambda sa, cfg=cfg: cfg)
        monkeypatch.setenv(O.ENV["query_backend"], "allgather")
        monkeypatch.setenv(O.ENV["indexer_backend"], "owner_sharded")
        monkeypatch.setenv(O.ENV["topk_backend"], "vmm")
        sa = _record(dcp_size=2, dcp_comm_backend="a2a")
        if ok:
            plugin._resolution_step(sa, prev)
        else:
            with pytest.raises(ValueError, match="index_topk"):
                plugin._resolution_step(sa, prev)


def test_geometry_from_model():
    class Attn(torch.nn.Module):
        def __init__(self, dcp):
            super().__init__()
            self.dcp_size, self.num_local_heads, self.kv_lora_rank, self.qk_rope_head_dim = dcp, 16, 512, 64
            self.attn_mqa_for_dcp_decode = torch.nn.Identity() if dcp > 1 else None
            self.current_attention_backend = "flashinfer"

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Attn(2), Attn(2))
    assert plugin._find_mla_geometry(model) == {
        "heads_per_rank": 16,
        "kv_lora_rank": 512,
        "rope_dim": 64,
        "lse_base": 2,
    }
    model[1].current_attention_backend = "flashmla"
    assert plugin._find_mla_geometry(model)["lse_base"] == "e"
    assert plugin._find_mla_geometry(torch.nn.Sequential(Attn(1))) is None  # e.g. the NextN draft (dcp 1)


# --- two processes: SGLang's own DCP functions routed to peerdcp ----------------------------------------------------
HOST = {"PEERDCP_SGLANG_MEMORY": "host", "PEERDCP_SGLANG_TIMEOUT_S": "60"}


def test_sglang_merge_and_query_routed_two_ranks(pools):
    pool = pools(2)
    bf, fp = torch.bfloat16, torch.float16
    cases = [
        # forward_mla's path for --dcp-comm-backend vmm: cp_lse_ag_out_rs_mla -> [H, T, D]
        dict(name="agrs-vmm-b2", fn="ag_rs", configured="vmm", seed=11, T=3, H=2, D=16, dtype=bf, base_e=False),
        # same function through the package re-export forward_mla imports, symm_a2a, base e, fp16
        dict(
            name="agrs-pkg-symm-e",
            fn="ag_rs_pkg",
            configured="symm_a2a",
            seed=12,
            T=1,
            H=2,
            D=16,
            dtype=fp,
            base_e=True,
        ),
        # dcp_a2a_lse_reduce with an explicit comm_backend (#33364's calling convention) -> [T, H, D]
        dict(
            name="a2a-arg-vmm",
            fn="a2a",
            configured="",
            comm_backend="vmm",
            seed=13,
            T=3,
            H=2,
            D=16,
            dtype=bf,
            base_e=True,
        ),
        # dcp_a2a_lse_reduce without comm_backend: the configured backend decides
        dict(name="a2a-cfg-symm", fn="a2a", configured="symm_a2a", seed=14, T=2, H=2, D=16, dtype=bf, base_e=False),
        # back-to-back calls on the same workspace with fresh inputs (parity slots)
        dict(name="agrs-vmm-again", fn="ag_rs", configured="vmm", seed=15, T=3, H=2, D=16, dtype=bf, base_e=False),
        dict(name="agrs-vmm-again2", fn="ag_rs", configured="vmm", seed=16, T=2, H=2, D=16, dtype=bf, base_e=False),
    ]
    res = pool.run(R.merge_cases, HOST, cases)
    for rank, rr in enumerate(res):
        assert rr["group"] == "GroupCoordinator", rr["group"]  # SGLang's own coordinator (gloo)
        for c, got in zip(cases, rr["results"]):
            want_route = c.get("comm_backend") or c["configured"]
            assert got["served"] == {f"merge:{want_route}": 1}, (rank, got)
            assert got["layout_ok"] and got["dtype_ok"] and got["finite"], (rank, got)
            assert got["empty_row_zero"], (rank, got)
            assert got["within_tol"], (rank, got)
        mems = {(o["backend"], o["memory"]) for o in rr["objects"]}
        assert mems == {("vmm", "host"), ("symm_a2a", "host")}, mems
        # one object per (route, geometry, LSE base), reused across calls: vmm bf16 base 2 and base e,
        # symm_a2a fp16 base e and bf16 base 2
        assert len(rr["objects"]) == 4, rr["objects"]

    q = pool.run(R.query_case, {**HOST, "PEERDCP_SGLANG_DCP_QUERY_BACKEND": "vmm_direct"}, 21, 3, 2, 32, 16)
    for rr in q:
        assert rr["served"] == 1 and rr["equal"], rr
        assert rr["shapes"] == [(3, 4, 32), (3, 4, 16)] and rr["dtypes"] == ["torch.bfloat16"] * 2

    # start-up step: owner_sharded / topk vmm cannot be routed in 0.5.23 -> clear error on every rank
    env = {**HOST, "PEERDCP_SGLANG_DCP_INDEXER_BACKEND": "owner_sharded", "PEERDCP_SGLANG_DCP_TOPK_BACKEND": "vmm"}
    for rr in pool.run(R.prepare_case, env, 2, 16, 16, 4):
        assert "cannot be routed in sglang 0.5.23" in rr["error"], rr
    # peer memory not eligible (vmm on a CPU-only group): start-up fails naming the probe's reason ...
    env = {
        **HOST,
        "PEERDCP_SGLANG_MEMORY": "vmm",
        "PEERDCP_SGLANG_DCP_INDEXER_BACKEND": "replicated",
        "PEERDCP_SGLANG_DCP_TOPK_BACKEND": "allgather",
        "PEERDCP_SGLANG_DCP_COMM_BACKEND": "vmm",
    }
    for rr in pool.run(R.prepare_case, env, 2, 16, 16, 4):
        assert rr["error"].startswith("PeerSetupError: peerdcp: --dcp-comm-backend vmm cannot start"), rr
        assert "vmm peer memory is not eligible" in rr["error"] and "CUDA" in rr["error"], rr
    # ... or, with --dcp-peer-fallback a2a, records the fallback (warning) and creates nothing for it
    for rr in pool.run(R.prepare_case, {**env, "PEERDCP_SGLANG_DCP_PEER_FALLBACK": "a2a"}, 2, 16, 16, 4):
        assert rr["error"] is None and "vmm" in rr["fallback"], rr
    # and the pre-capture step creates the objects on eligible memory
    env = {
        **HOST,
        "PEERDCP_SGLANG_DCP_COMM_BACKEND": "vmm",
        "PEERDCP_SGLANG_DCP_QUERY_BACKEND": "vmm_direct",
        "PEERDCP_SGLANG_DCP_PEER_FALLBACK": "error",
        "PEERDCP_SGLANG_DCP_INDEXER_BACKEND": "replicated",
        "PEERDCP_SGLANG_DCP_TOPK_BACKEND": "allgather",
    }
    pool.run(R.close_workspaces)
    for rr in pool.run(R.prepare_case, env, 2, 16, 16, 4):
        assert rr["error"] is None, rr
        assert {(o["route"], o["memory"]) for o in rr["objects"]} == {("output", "host"), ("query", "host")}, rr
    for rr in pool.run(R.close_workspaces):
        assert rr == {"closed": 2, "left": 0}


def test_env_knobs_are_checked_with_the_flags():
    """``PEERDCP_SGLANG_TIMEOUT_S`` / ``PEERDCP_SGLANG_MAX_TOKENS`` are validated with the flags (so a bad value
    fails at the launcher, not in every worker as a bare ValueError)."""
    assert O.env_problems({}) == []
    assert O.env_problems({O.ENV_TIMEOUT: "30", O.ENV_MAX_TOKENS: "64"}) == []
    for env, what in (({O.ENV_TIMEOUT: "ten"}, "not a number"), ({O.ENV_TIMEOUT: "inf"}, "at most"),
                      ({O.ENV_TIMEOUT: "0"}, "positive"), ({O.ENV_MAX_TOKENS: "0"}, "positive integer"),
                      ({O.ENV_MAX_TOKENS: "8.5"}, "positive integer")):  # fmt: skip
        (msg,) = O.env_problems(env)
        assert what in msg, (env, msg)


def test_peer_routes_on_a_model_without_mla_fail_start_up(monkeypatch):
    """DCP with peer routes on an MHA model (SGLang's ``cp_lse_ag_out_rs_mha`` path, which no route replaces) used
    to pass the pre-capture hook silently; an MLA runner without DCP attention (a NextN draft) still gets none."""
    import enum
    import types

    import sglang.srt.runtime_context as rc

    # (SGLang's AttentionArch lives in its model_config module, which imports transformers: a stand-in by name)
    AttentionArch = enum.Enum("AttentionArch", "MLA MHA")

    monkeypatch.setenv(O.ENV["comm_backend"], "vmm")
    O.reset()
    try:
        monkeypatch.setattr(rc, "get_parallel", lambda: types.SimpleNamespace(dcp_enabled=True, dcp_group=object()))

        def runner(arch):
            mr = types.SimpleNamespace(model=torch.nn.Sequential(torch.nn.Linear(2, 2)), dtype=torch.bfloat16,
                                       model_config=types.SimpleNamespace(attention_arch=arch))  # fmt: skip
            return types.SimpleNamespace(model_runner=mr, _widest_decode_rows=lambda: 8)

        with pytest.raises(plugin.PeerSetupError, match="MHA"):
            plugin._after_pre_capture(None, runner(AttentionArch.MHA))
        assert plugin._after_pre_capture(None, runner(AttentionArch.MLA)) is None
    finally:
        O.reset()
