"""The rank side of ``peerdcp generate``: one model decoded with DCP beside the same model unsharded.

Run on every rank of a :class:`peerdcp.harness.launch.RankPool` (state lives in the worker between phases, so the driver
can show progress per phase)::

    setup            the model (tiny random config of a family, or a config.json [+ safetensors]), seeded alike on
                     every rank; three copies: DCP (the chosen backends), reference, DCP on the collective backends
    reference_free   the reference's greedy tokens, logits and top-1/top-2 margins
    dcp_forced       DCP teacher-forced on the reference's tokens, every exchange checked (checks.py); its top-k
                     ids and its MoE routing logged
    reference_forced the reference teacher-forced with both selections pinned to DCP's: the top-k ids, and the
                     experts each MoE router chose (a router is a discrete choice after attention just as the
                     indexer is: one bf16 ulp of attention output can flip a near tie between two experts)
    dcp_free         DCP's own greedy tokens (timed per decode token), then the collective backends' (timed)

Every generation goes through transformers' ``generate`` (greedy); teacher forcing is a logits processor that
leaves only the given token, and the raw logits come from ``output_logits``.

:func:`run_phases` is the driver's side: it calls the phases on a pool in order. Untimed, it runs ``dcp_free``
first with every exchange checked; when every rank's greedy tokens equal the reference's, that run *is* the
teacher-forced run (its inputs were the reference's tokens, step by step), so :func:`adopt_free_as_forced` takes
its logits, ids and routing instead of decoding again (a third of an untimed case's time).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "setup",
    "reference_free",
    "dcp_forced",
    "reference_forced",
    "dcp_free",
    "adopt_free_as_forced",
    "capacity",
    "teardown",
    "run_phases",
]

_S: dict[str, Any] = {}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Force:
    """A logits processor: at step i only token ``tokens[:, i]`` may be chosen (teacher forcing)."""

    def __init__(self, tokens: torch.Tensor, prompt_width: int) -> None:
        self.tokens, self.width = tokens, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        i = input_ids.shape[1] - self.width
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, self.tokens[:, i : i + 1].to(scores.device), 0.0)
        return out


class _Clock:
    """A logits processor that only records when each step's logits were ready (after a device sync)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _sync()
        self.stamps.append(time.perf_counter())
        return scores

    def per_token_ms(self) -> float | None:
        """Median milliseconds between consecutive decode steps (the prompt's step excluded)."""
        d = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return float(torch.tensor(d).median()) * 1e3 if d else None


class _Routing:
    """Forward hooks on every MoE router (``mlp.gate``) of a model: ``record`` each call's chosen experts, or
    ``pin`` the recorded ones (the weights recomputed from this model's own router scores, as transformers'
    router computes them: sigmoid, gathered, normalized, scaled)."""

    def __init__(self, model) -> None:
        self.gates = [lay.mlp.gate for lay in model.model.layers if hasattr(lay.mlp, "gate")]
        self.log: list[list[torch.Tensor]] = [[] for _ in self.gates]
        self.pinned: list[list[torch.Tensor]] | None = None
        self.flips = 0  # router rows whose own choice differed from the pinned one
        self._calls = [0] * len(self.gates)
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(lambda mod, inp, out, i=i: self._hook(i, mod, out))

    def start(self, pinned: list[list[torch.Tensor]] | None) -> None:
        self.log = [[] for _ in self.gates]
        self.pinned, self.flips, self._calls = pinned, 0, [0] * len(self.gates)

    def _hook(self, i: int, gate, out):
        logits, weights, idx = out
        if self.pinned is None:
            self.log[i].append(idx.detach().clone())
            return None
        k = self._calls[i]
        self._calls[i] += 1
        want = self.pinned[i][k].to(idx.device)
        if torch.equal(want, idx):
            return None
        self.flips += int((want.sort(-1).values != idx.sort(-1).values).any(-1).sum())
        w = logits.sigmoid().gather(1, want)
        if gate.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, (w * gate.routed_scaling_factor).to(weights.dtype), want


def _build(family: str, size: str, config_path: str | None, weights_path: str | None, seed: int, overrides: dict):
    import transformers

    from .configs import SIZES

    if config_path:
        cfg = transformers.AutoConfig.from_pretrained(config_path)
        for k, v in overrides.items():
            setattr(cfg, k, v)
    else:
        cfg = SIZES[size](family, **overrides)
    torch.manual_seed(seed)  # the same weights on every rank
    if not weights_path:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    else:
        # transformers' own loader: checkpoints store experts per expert, the modules fused (its conversion)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            weights_path, config=cfg, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
        )
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise ValueError(f"--weights {weights_path}: {len(missing)} parameters missing, e.g. {missing[:3]}")
    model.generation_config.eos_token_id = None  # fixed-length greedy decode: the two sides stay aligned
    model.generation_config.pad_token_id = 0
    return model.eval()


def setup(args: dict) -> dict:
    """Build the three model copies and their peerdcp objects (collective)."""
    from .model import DCPOptions, reference_model, shard_model

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args["dtype"]]
    base = _build(
        args["family"],
        args.get("size", "tiny"),
        args.get("config"),
        args.get("weights"),
        args["seed"],
        args.get("overrides", {}),
    )
    base = base.to(device=dev, dtype=dtype)
    B, P, N = args["batch"], args["prompt_len"], args["new_tokens"]
    opts = dict(
        max_batch=B,
        max_len=P + N + 1,
        chunk=args["chunk"],
        interleave=args["interleave"],
        indexer=args["indexer"],
        query_dtype=torch.float8_e4m3fn if args["query"] == "fp8" else torch.bfloat16,
        memory=args["memory"],
        timeout_s=args["timeout_s"],
        record=True,
        fault=args["fault"],
    )
    _S.clear()
    _S.update(args=args, dev=dev)
    m_dcp, m_ref, m_col = base, copy.deepcopy(base), copy.deepcopy(base) if args["timing"] else None
    dcp = shard_model(m_dcp, None, DCPOptions(backends=dict(args["backends"]), **opts))
    ref = reference_model(m_ref, None, DCPOptions(**opts))
    _S.update(m_dcp=m_dcp, m_ref=m_ref, dcp=dcp, ref=ref, route_dcp=_Routing(m_dcp), route_ref=_Routing(m_ref))
    import transformers

    info = {
        "mechanisms": dcp.info,
        "family": dcp.family,
        "transformers": transformers.__version__,
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
    }
    if m_col is not None:
        col = shard_model(
            m_col, None, DCPOptions(backends={m: "collective" for m in dcp.info if m != "indexer"}, **opts)
        )
        _S.update(m_col=m_col, col=col)
        info["collective"] = col.info
    # prompts: random tokens, row b shorter by b * P / (2B) (left padded: transformers' convention for generate)
    g = torch.Generator().manual_seed(args["seed"] + 1)
    vocab = base.config.vocab_size
    ids = torch.randint(1, vocab, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.int64)
    lens = [P - (b * P) // (2 * B) for b in range(B)]
    for b, n in enumerate(lens):
        ids[b, : P - n], mask[b, : P - n] = 0, 0
    _S.update(ids=ids.to(dev), mask=mask.to(dev))
    c = base.config
    info.update(prompt_lens=lens, heads_per_rank=dcp.H, topk=dcp.topk, size=args.get("size", "tiny"),
                geometry=dict(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                              kv_lora=c.kv_lora_rank, rope=c.qk_rope_head_dim,
                              index=f"{c.index_n_heads}x{c.index_head_dim}" if dcp.dsa else None))  # fmt: skip
    return info


def _generate(model, runtime, *, force: torch.Tensor | None = None, clock: _Clock | None = None):
    from transformers import LogitsProcessorList

    B, P = _S["ids"].shape
    procs = LogitsProcessorList()
    if force is not None:
        procs.append(_Force(force, P))
    if clock is not None:
        procs.append(clock)
    runtime.reset_logs()
    cache = runtime.new_cache(B)
    with torch.no_grad():
        out = model.generate(
            _S["ids"],
            attention_mask=_S["mask"],
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=_S["args"]["new_tokens"],
            logits_processor=procs,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.stack([x.float() for x in out.logits], dim=1).cpu()  # [B, N, V]
    return out.sequences[:, P:].cpu(), logits, cache


def reference_free() -> dict:
    """The reference's own greedy decode: tokens, and the top-1 / top-2 margin of each step."""
    ref = _S["ref"]
    ref.pin(None)
    _S["route_ref"].start(None)
    tokens, logits, cache = _generate(_S["m_ref"], ref)
    top2 = logits.topk(2, dim=-1).values
    _S.update(ref_tokens=tokens, ref_logits=logits, ref_ids=ref.ids_log, ref_cache=cache)
    return {"tokens": tokens.tolist(), "margin": (top2[..., 0] - top2[..., 1]).tolist()}


def dcp_forced() -> dict:
    """DCP teacher-forced on the reference's tokens, every exchange checked; the ids it selected are logged."""
    dcp = _S["dcp"]
    dcp.checks.enabled, dcp.checks.where = True, "teacher-forced decode"
    _S["route_dcp"].start(None)
    _, logits, _ = _generate(_S["m_dcp"], dcp, force=_S["ref_tokens"])
    dcp.checks.enabled = False
    _S.update(dcp_forced_logits=logits, dcp_forced_ids=dcp.ids_log)
    return {"checks": dcp.checks.stats, "from": "teacher-forced decode"}


def reference_forced() -> dict:
    """The reference teacher-forced on its own tokens with DCP's selection; per step the largest logit
    difference from DCP's and the largest reference logit."""
    ref = _S["ref"]
    ref.pin(_S["dcp_forced_ids"] if _S["dcp"].dsa else None)
    route = _S["route_ref"]
    route.start(_S["route_dcp"].log)
    _, logits, _ = _generate(_S["m_ref"], ref, force=_S["ref_tokens"])
    ref.pin(None)
    route.start(None)
    diff = (_S["dcp_forced_logits"] - logits).abs().amax(dim=-1)  # [B, N]
    flips = _ids_differ(ref.ids_log, _S["dcp_forced_ids"]) if _S["dcp"].dsa else {}
    return {
        "max_diff": diff.tolist(),
        "max_abs": logits.abs().amax(dim=-1).tolist(),
        "router_rows_pinned": route.flips,
        "topk_calls_pinned": len(flips),
    }


def dcp_free(checked: bool = False) -> dict:
    """DCP's own greedy decode on the chosen backends (timed per decode token), then on the collective ones.

    ``checked``: every exchange checked as in :func:`dcp_forced` (the timing then measures the checks too, so
    the driver asks for it only untimed)."""
    dcp = _S["dcp"]
    clock = _Clock()
    _S["route_dcp"].start(None)
    if checked:
        dcp.checks.enabled, dcp.checks.where = True, "greedy decode"
    try:
        tokens, logits, cache = _generate(_S["m_dcp"], dcp, clock=clock)
    finally:
        dcp.checks.enabled = False
    res: dict[str, Any] = {"tokens": tokens.tolist(), "ms_per_token": clock.per_token_ms()}
    ref_ids, ids = _S["ref_ids"], dcp.ids_log
    res["ids_differ"] = _ids_differ(ref_ids, ids)
    _S.update(dcp_cache=cache, dcp_free_tokens=tokens, dcp_free_logits=logits, dcp_free_ids=ids, free_checked=checked)
    if "col" in _S:
        clock = _Clock()
        tokens_c, _, _ = _generate(_S["m_col"], _S["col"], clock=clock)
        res.update(collective_tokens=tokens_c.tolist(), collective_ms_per_token=clock.per_token_ms())
    return res


def adopt_free_as_forced() -> dict:
    """Take the checked greedy decode as the teacher-forced one (what :func:`dcp_forced` returns).

    Valid only where that decode's tokens equal the reference's on every rank (the driver decides, from every
    rank's tokens, so that all ranks take the same branch): then each of its steps was fed the reference's
    token, which is all teacher forcing does, and its logits, top-k ids and MoE routing are the forced run's."""
    if not _S.get("free_checked"):
        raise RuntimeError("adopt_free_as_forced needs dcp_free(checked=True) first")
    if not torch.equal(_S["dcp_free_tokens"], _S["ref_tokens"]):
        raise RuntimeError("adopt_free_as_forced: the greedy tokens differ from the reference's; run dcp_forced")
    _S.update(dcp_forced_logits=_S["dcp_free_logits"], dcp_forced_ids=_S["dcp_free_ids"])
    return {"checks": _S["dcp"].checks.stats, "from": "greedy decode"}


def _ids_differ(a: dict, b: dict) -> dict:
    """Per call index (0 = the prompt), per layer: the ids of each batch row's last token that one selection has
    and the other lacks (only where they differ)."""
    out: dict = {}
    for layer, calls in a.items():
        for k, (x, y) in enumerate(zip(calls, b.get(layer, []))):
            for row in range(x.shape[0]):
                sx, sy = set(x[row, -1].tolist()) - {-1}, set(y[row, -1].tolist()) - {-1}
                if sx != sy:
                    out.setdefault(k, {}).setdefault(layer, {})[row] = {
                        "reference_only": sorted(sx - sy)[:8],
                        "dcp_only": sorted(sy - sx)[:8],
                    }
    return out


def capacity() -> dict:
    """KV and index-K bytes this rank holds for the decoded sequences against one unsharded copy's."""
    from ...topk.reference import local_length

    dcp = _S["dcp"]
    cache = _S["dcp_cache"]
    n, B = cache.layers[0].length, _S["ids"].shape[0]
    res = {
        "rank": dcp.rank,
        "columns": n,
        "local_columns": int(local_length(n, dcp.rank, dcp.W, dcp.options.interleave)),
        "kv_bytes_local": cache.bytes_local(),
        "kv_bytes_replicated": _S["ref_cache"].bytes_local(),
    }
    if dcp.dsa:
        cfg = _S["m_dcp"].config
        layers = sum(1 for lay in _S["m_ref"].model.layers if lay.self_attn.has_indexer)
        # FP8 keys: head_dim bytes + a 4-byte scale per token (the IndexKCache page layout); exact: the model's dtype
        per_token = (
            cfg.index_head_dim + 4 if dcp.options.indexer == "fp8" else cfg.index_head_dim * _S["m_dcp"].dtype.itemsize
        )
        res.update(
            index_k_bytes_local=layers * B * res["local_columns"] * per_token,
            index_k_bytes_replicated=layers * B * n * per_token,
        )
    return res


def teardown() -> bool:
    for k in ("dcp", "col", "ref"):
        if k in _S:
            _S[k].close()
    _S.clear()
    return True


def run_phases(
    pool, args: dict, on_phase: Callable[[str], None] | None = None, timeout: float = 1800.0
) -> dict[str, list]:
    """Run every phase on ``pool`` (a :class:`~peerdcp.harness.launch.RankPool` of the DCP group) with the
    arguments of :func:`setup`; returns each phase's per-rank results by name (``setup``, ``reference_free``,
    ``dcp_forced``, ``reference_forced``, ``dcp_free``, ``capacity``); the ranks' models and peer memory are
    closed after, also when a phase fails (unless the pool is broken). Untimed, when the checked greedy decode is
    not adopted, ``dcp_forced``'s check counts cover both checked decodes (a failure names the decode it was in).
    ``on_phase(description)`` is called before each of the ``PHASES`` phases (a progress display)."""
    out: dict[str, list] = {}

    def step(desc: str, key: str | None, fn, *a) -> list:
        if on_phase is not None:
            on_phase(desc)
        res = pool.run(fn, *a, timeout=timeout)
        if key:
            out[key] = res
        return res

    step("build the model copies and the peerdcp objects (collective)", "setup", setup, args)
    try:
        ref = step("unsharded reference: greedy decode", "reference_free", reference_free)[0]
        if args["timing"]:
            step("DCP teacher-forced, every exchange checked", "dcp_forced", dcp_forced)
        else:
            free = step("DCP greedy decode, every exchange checked", "dcp_free", dcp_free, True)
            if all(r["tokens"] == ref["tokens"] for r in free):
                step("greedy tokens equal the reference's: that run is the teacher-forced one", "dcp_forced",
                     adopt_free_as_forced)  # fmt: skip
            else:
                step("DCP teacher-forced, every exchange checked", "dcp_forced", dcp_forced)
        step("unsharded reference teacher-forced, selection pinned to DCP's", "reference_forced", reference_forced)
        if args["timing"]:
            step("DCP greedy decode (timed), then on the collective backends", "dcp_free", dcp_free)
        step("capacity", "capacity", capacity)
    except BaseException:
        if not getattr(pool, "broken", False):  # the ranks still answer: free their peer memory before the error
            with contextlib.suppress(Exception):
                pool.run(teardown, timeout=timeout)
        raise
    step("close", None, teardown)
    return out


PHASES = 7  # on_phase calls of run_phases
