"""vLLM 0.34.0's fused RoPE + FP8 query kernel (``fused_q``) as a Query-gather peer (issue 54).

``vllm/models/deepseek_v32/common/kernels.py`` holds ``fused_q``: one Triton kernel that rotates the MLA
query's rope part (interleaved pairs) and, for an FP8 query, divides every value by the per-tensor
``q_scale`` and packs ``[ql_nope | q_pe]`` into one e4m3 tensor; for a BF16 query it writes only the
rotated ``q_pe`` (the consumer pairs it with ``ql_nope``). vLLM's DCP decode then all-gathers the query
heads over NCCL. The peer is therefore this rank's ``fused_q`` of its own heads, then
``all_gather_into_tensor`` and the rank-major reorder into ``[T, W*H, 576]`` (what vLLM's ``all_gather(dim=1)``
does), so that its bytes compare with ``peerdcp.query.reference.widened_query``.

It runs with ``has_indexer=False`` (under DCP the indexer query is replicated: no exchange) and
``q_scale = 1`` (the scale the FP8 consumers use; see /work/shared/notes/dsa-query-topk.md section 2.2).
On CUDA vLLM first tries ``fused_q_cutedsl`` (CuTeDSL, nvidia-cutlass-dsl); the stand-in platform keeps the
Triton kernel, which vLLM runs wherever the CuTeDSL one is unsupported.

Check (:func:`verdict`): byte equality with ``widened_query`` first, else every element inside
``widened_query_bounds``. The bound brackets what any fp32 evaluation of the same formula gives (each
product and sum rounded once; a fused multiply-add, which Triton emits on the GPU unless told otherwise,
rounds fewer times and stays inside it), so a peer inside it computes the same answer at fp32 accuracy and
may be timed; one outside it is "different" and is not timed.
"""

from __future__ import annotations

import types

import torch

from bench import peers

REL = "vllm/models/deepseek_v32/common/kernels.py"
NAME = "vllm-fused_q"


def load() -> tuple[types.ModuleType | None, str]:
    """vLLM's ``kernels`` module (``fused_q``), or ``(None, why)``."""
    mod, why = peers.load_vllm_file(REL)
    if mod is not None and not hasattr(mod, "fused_q"):
        return None, f"{why}: has no fused_q"
    return mod, why


def rank_rows(
    mod: types.ModuleType,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out_dtype: torch.dtype,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's rows through vLLM's ``fused_q``: ``[T, H, 512 + 64]`` in ``out_dtype``.

    FP8: vLLM's packed output as is. BF16: ``cat(ql_nope, rotated q_pe)`` (vLLM passes the two to its
    attention backend as a pair; the all-gather needs one buffer).
    """
    if q_scale is None:
        q_scale = torch.ones(1, dtype=torch.float32, device=q_pe.device)
    fp8 = out_dtype == torch.float8_e4m3fn
    _, _, mqa = mod.fused_q(
        positions.long(),
        q_pe,
        cos_sin_cache,
        None,
        None,
        q_nope,
        q_scale,
        None,
        1.0,
        1.0,
        has_indexer=False,
        quantize_mqa=fp8,
    )
    return mqa if fp8 else torch.cat((q_nope, mqa), dim=-1)


def verdict(
    got: torch.Tensor, q_nopes, q_pes, positions: torch.Tensor, cos_sin_cache: torch.Tensor, out_dtype: torch.dtype
) -> tuple[str, str]:
    """``("byte-equal" | "inside-bound" | "different", detail)`` of a widened query against peerdcp's reference."""
    from peerdcp.query import reference as ref

    dev = got.device  # the reference is plain torch: on a GPU the fp64 bound of a large case takes milliseconds
    args = ([n.to(dev) for n in q_nopes], [p.to(dev) for p in q_pes], positions.to(dev), cos_sin_cache.to(dev))
    want = ref.widened_query(*args, out_dtype=out_dtype)
    if got.shape != want.shape:
        return "different", f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    n_diff = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
    if n_diff == 0:
        return "byte-equal", f"{got.numel()} values byte-equal to widened_query"
    lo, hi = ref.widened_query_bounds(*args, out_dtype=out_dtype)
    g, lo, hi = got.float(), lo.float(), hi.float()
    outside = int(((g < lo) | (g > hi) | g.isnan()).sum())
    err = float((g - want.float()).abs().nan_to_num(float("inf")).max())
    detail = (
        f"{n_diff}/{got.numel()} bytes differ from widened_query, {outside} outside its fp32 bound, max abs {err:.4g}"
    )
    return ("inside-bound" if outside == 0 else "different"), detail


def check(
    device: str, world: int = 2, T: int = 4, H: int = 8, out_dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 54
) -> tuple[bool | None, str]:
    """vLLM's ``fused_q`` for ``world`` simulated ranks (the all-gather is a concatenation of the ranks' rows),
    DeepSeek-V3.2 YaRN table, random positions: ``(True, detail)`` byte-equal or inside the bound,
    ``(False, detail)`` different, ``(None, why)`` not loadable."""
    from peerdcp.query.rope import cos_sin_cache

    mod, why = load()
    if mod is None:
        return None, why
    cs = cos_sin_cache("deepseek-v3.2", device=device)
    g = torch.Generator().manual_seed(seed)
    nopes = [torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(device) for _ in range(world)]
    pes = [torch.randn(T, H, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(world)]
    pos = torch.randint(0, cs.shape[0], (T,), generator=g).to(device)
    got = torch.cat([rank_rows(mod, nopes[r], pes[r], pos, cs, out_dtype) for r in range(world)], dim=1)
    res, detail = verdict(got, nopes, pes, pos, cs, out_dtype)
    name = "fp8" if out_dtype == torch.float8_e4m3fn else "bf16"
    return res != "different", f"{name} W={world} T={T} H={H}: {res}: {detail}"
