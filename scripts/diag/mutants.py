"""A mutation audit of the test suite: hand-picked faults in the code the tests run (CPU, or with ``--gpu`` the GPU
tests), and whether the tests that claim to cover each one fail.

Each mutant is one textual change (a flipped comparison, a dropped guard, one slot instead of two, a missing
rounding term) of the kind a refactor could make silently. It is applied to a *separate* checkout (``--tree``, e.g.
``git worktree add --detach /tmp/mut HEAD``), the named tests run there (``PYTHONPATH`` points at that tree, so
the installed editable package is not used), and the file is restored. A mutant is *killed* when the tests fail,
*survived* when they pass; a survivor is either a missing test (fix the tests) or an equivalent mutant (say why in
``note``). The tests are first run once on the unmutated tree: a baseline failure invalidates the audit.

    git worktree add --detach /tmp/mut HEAD
    python scripts/diag/mutants.py --tree /tmp/mut [--only NAME ...] [--json out.json]

GPU mutants of ``csrc/`` need their libraries built (~1 min of nvcc each, on the device's clock): build them where
nvcc is (no GPU needed) into a cache of their own, ship it, and unpack it into the device's ``$PEERDCP_CACHE``
(the JIT cache is keyed by the sources' bytes, so a mutant tree finds its library there; a mutant whose build failed
would otherwise fall back to an exact Triton path in some callers and pass):

    python scripts/diag/mutants.py --tree /tmp/mut --gpu --only cuda.select --prebuild /tmp/mutcache
    tar -C /tmp/mutcache -cJf mutlibs.tar.xz .        # ~0.25 MB per topk library

Tool: plain pytest per mutant (mutmut-style tools re-run whole suites per mutant; the CPU tests spawn rank
processes, so a targeted selection per mutant is what fits a 2-core CI machine).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from peerdcp.memory.host import SHM_DIR, SHM_PREFIX


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the tree
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids / args
    note: str = ""
    equivalent: bool = False  # behaves like the original on every input the contract allows (note says why)
    gpu: bool = False  # killed (or not) by GPU tests: run with --gpu on a GPU machine
    covered_by: str = ""  # a CPU mutant the CPU tests cannot see: the GPU mutant (same change) that is killed


TOPK, OUT, QH, TEST_PROPS, MEM = (
    "tests/test_topk_host.py::",
    "tests/test_output.py::",
    "tests/test_query_host.py::",
    "tests/test_properties.py::",
    "tests/test_memory_host.py::",
)
QG = "tests/test_query_gpu.py::"
COLL = "tests/test_collective_timeout.py::"
SEL_NEW = "tests/test_topk_local_gpu.py::test_gpu_select_rows_past_the_width_and_short_tied_rows"
TOPK_SEL = (
    TOPK + "test_exact_selection_small_k",
    TOPK + "test_exact_selection_k64_w3",
    TEST_PROPS + "test_canonical_topk_kernel_matches_bruteforce",
)
TOPK_B2B = (TOPK + "test_fifty_back_to_back_without_barrier",)
TOPK_CACHE = (
    TOPK + "test_cache_write_read_roundtrip",
    TOPK + "test_scoring_kernel_against_reference",
    TOPK + "test_sharded_pipeline_selects_what_replicated_selects",
)
TOPK_SCORE = (
    TOPK + "test_scoring_kernel_against_reference",
    TOPK + "test_sharded_pipeline_selects_what_replicated_selects",
)
OUT_REF = (OUT + "test_backends_agree_with_reference",)
OUT_B2B = (OUT + "test_direct_50_back_to_back_calls",)
OUT_TIES = (OUT + "test_exact_ties_round_to_even",)
Q_HOST = (QH + "test_interpreter_conversions_match_torch", QH + "test_direct_and_allgather_byte_identical")
Q_B2B = (QH + "test_50_back_to_back_calls_without_barrier",)

K = "peerdcp/topk/kernels.py"
S = "peerdcp/topk/selector.py"
TC = "peerdcp/topk/candidates.py"
O = "peerdcp/output/kernels.py"
Q = "peerdcp/query/kernels.py"
QR = "peerdcp/query/rows.py"
KS = "peerdcp/_runtime/device.py"
SENT = "peerdcp/output/sentinel.py"
MRG = "csrc/topk/merge.cu"
SC = "csrc/topk/score.cu"
MT = "tests/test_topk_merge_gpu.py::test_cuda_merge_matches_topk_for_every_cta_count"
ONE = "tests/test_topk_local_gpu.py::test_gpu_scan_against_reference_on_one_rank"
TG = "tests/test_topk_gpu.py::"
OD = "csrc/output/direct.cu"
QD = "csrc/query/direct.cu"
OG = "tests/test_output_gpu.py::"

MUTANTS: tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- Top-K: keys, force, merge, owned, cache
    Mutant("topk.key.neg_zero", K, "s = tl.where(s == 0.0, 0.0, s)  # -0.0 == +0.0", "s = s", TOPK_SEL),
    Mutant("topk.key.nan_lowest", K, "o = tl.where(s != s, 0, o)  # NaN", "o = o  #", TOPK_SEL),
    Mutant(
        "topk.key.neg_order",
        K,
        "o = tl.where(b < 0, -b - 1, b + 2147483647 + 1)",
        "o = tl.where(b < 0, -b, b + 2147483647 + 1)",
        TOPK_SEL,
        "keeps the order (negative keys one higher): only the key values of local_candidates() show it",
    ),
    Mutant("topk.keys.force_last", K, "(g >= L - force_last), float", "(g > L - force_last), float", TOPK_SEL),
    Mutant("topk.keys.force_first", K, "(g < force_first) | (g >= L", "(g <= force_first) | (g >= L", TOPK_SEL),
    Mutant("topk.keys.valid_len", K, "valid = m & (g < L)", "valid = m & (g <= L)", TOPK_SEL),
    Mutant(
        "topk.merge.logk_short",
        TC,
        "LOGK=k.bit_length(),",
        "LOGK=k.bit_length() - 1,",
        (
            TEST_PROPS + "test_canonical_topk_kernel_matches_bruteforce",
            TOPK + "test_rows_beyond_max_rows_use_allgather",
        ),
    ),
    Mutant("topk.merge.direct_logk_short", S, "LOGK=K.bit_length(),", "LOGK=K.bit_length() - 1,", TOPK_SEL),
    Mutant(
        "topk.merge.drop_bound",
        K,
        "mask=xvalid & (pos < K))",
        "mask=xvalid & (pos <= K))",
        TOPK_SEL,
        "a store one past the row: lands in the next row's first slot (seen when that row is empty)",
    ),
    Mutant(
        "topk.merge.one_slot",
        K,
        "        slot = epoch % 2\n        if aborted",
        "        slot = 0\n        if aborted",
        TOPK_B2B + TOPK_SEL,
        "publish still writes the parity slot: the merge reads the other one",
    ),
    Mutant(
        "topk.publish.one_slot",
        K,
        "    slot = epoch % 2\n    for c in range(0, K, BLOCK):",
        "    slot = 0\n    for c in range(0, K, BLOCK):",
        TOPK_B2B + TOPK_SEL,
    ),
    Mutant("topk.owned.tail", K, "mask=m & (offs >= cnt))", "mask=m & (offs > cnt))", (TOPK_SEL[0],)),
    Mutant(
        "topk.owned.row",
        K,
        "lrow = (g0 // (I * W)) * I + g0 % I",
        "lrow = (g0 // (I * W)) * I",
        (TOPK_SEL[0],) + TOPK_B2B,
    ),
    Mutant(
        "topk.local_length.clamp", K, "rem = tl.minimum(tl.maximum(rem, 0), I)", "rem = tl.maximum(rem, 0)", TOPK_CACHE
    ),
    Mutant(
        "topk.write.capacity",
        K,
        "keep = mi & (s >= 0) & (s < capacity)",
        "keep = mi & (s >= 0)",
        (TOPK + "test_cache_write_read_roundtrip", TOPK + "test_cache_bad_input"),
    ),
    Mutant("topk.write.owner", K, "keep = keep & (((s // I) % W) == rank)", "keep = keep", TOPK_CACHE),
    Mutant(
        "topk.score.relu", K, "r = tl.sum(tl.maximum(s, 0.0) * wv[None, :]", "r = tl.sum(s * wv[None, :]", TOPK_SCORE
    ),
    Mutant(
        "topk.score.k_scale",
        K,
        "r = tl.sum(tl.maximum(s, 0.0) * wv[None, :], axis=1) * ks",
        "r = tl.sum(tl.maximum(s, 0.0) * wv[None, :], axis=1)",
        TOPK_SCORE,
    ),
    Mutant(
        "topk.score.past_length",
        K,
        'r = tl.where((l < nloc) & inb, r, float("-inf"))',
        'r = tl.where(inb, r, float("-inf"))',
        TOPK_SCORE,
    ),
    Mutant(
        "topk.score.table_width",
        K,
        "            inb = j < table_cols\n",
        "            inb = j >= 0\n",
        TOPK_SCORE,
        "a table narrower than the row: its missing columns read page 0",
    ),
    Mutant(
        "topk.score.sharded_length",
        K,
        "        nloc = _local_length(L, rank, W, I)\n",
        "        nloc = L\n",
        TOPK_SCORE,
    ),
    # ---------------------------------------------------------------- Output: sanitize, empty sources, parity
    Mutant(
        "out.sanitize.inf",
        O,
        'tl.where((l != l) | (l == float("inf")), float("-inf"), l)',
        'tl.where(l != l, float("-inf"), l)',
        OUT_REF,
    ),
    Mutant(
        "out.sanitize.nan",
        O,
        'tl.where((l != l) | (l == float("inf")), float("-inf"), l)',
        'tl.where(l == float("inf"), float("-inf"), l)',
        OUT_REF,
    ),
    Mutant("out.merged_lse.empty", O, 'return tl.where(s > 0, m + lg, float("-inf"))', "return m + lg", OUT_REF),
    Mutant(
        "out.direct.all_empty_max",
        O,
        '                mx = tl.maximum(mx, _sanitize(l))\n            mx = tl.where(mx == float("-inf"), 0.0, mx)',
        "                mx = tl.maximum(mx, _sanitize(l))\n            mx = mx",
        OUT_REF,
        "equivalent: with every source empty the weights are NaN, and NaN fails both 'w > 0' and 'ssum > 0'",
        equivalent=True,
    ),
    Mutant(
        "out.direct.empty_div",
        O,
        "            res = acc / tl.where(ssum > 0, ssum, 1.0)[:, None]",
        "            res = acc / ssum[:, None]",
        OUT_REF,
        "0 / 0 for a row whose sources are all empty",
    ),
    Mutant(
        "out.combine.reads_empty",
        O,
        "        ssum += w\n        acc += tl.where((w > 0)[:, None], w[:, None] * to_f32(x, GPU), 0.0)\n",
        "        x = tl.load(recv + (t * 0 + i) * s_n + t * s_t + heads[:, None] * s_h + dd[None, :], mask=m2)\n"
        "        ssum += w\n        acc += w[:, None] * to_f32(x, GPU)\n",
        OUT_REF,
        "both guards of rule 4 removed (either alone is covered by the other)",
    ),
    Mutant(
        "out.direct.one_slot",
        O,
        "    e = next_epoch(epochs + p)\n    slot = e % 2\n    fv",
        "    e = next_epoch(epochs + p)\n    slot = 0\n    fv",
        OUT_B2B,
    ),
    Mutant(
        "out.direct.flag_without_T",
        O,
        "fv = e * 1048576 + T",
        "fv = e * 1048576",
        (OUT + "test_ranks_disagreeing_on_T_time_out",),
    ),
    Mutant(
        "out.correct.lse_rank",
        O,
        "        if d == rank:\n            tl.store(out_lse",
        "        if d == 0:\n            tl.store(out_lse",
        OUT_REF,
    ),
    Mutant("out.cast.truncate", KS, "x = f32_to_bf16_bits(x)", "x = (x.to(tl.int32, bitcast=True) >> 16)", OUT_TIES),
    Mutant(
        "out.widen.interpreter_cast",
        O,
        "    y = tl.where((wr > 0)[:, None], scale[:, None] * to_f32(x, GPU), 0.0)",
        "    y = tl.where((wr > 0)[:, None], scale[:, None] * x.to(tl.float32), 0.0)",
        (OUT + "test_bf16_subnormal_payloads_exact",),
        "ag_rs: Triton 3.6's interpreter widens bf16 subnormals wrongly",
    ),
    # ---------------------------------------------------------------- Query: FP8 / bf16 bits, RoPE, parity
    Mutant("q.e4m3.saturate", QR, "((tl.minimum(a, 0x43E00000) + 0x7FFFF", "((a + 0x7FFFF", Q_HOST),
    Mutant("q.e4m3.rne", QR, "+ 0x7FFFF + ((a >> 20) & 1)) >> 20)", "+ 0x80000) >> 20)", Q_HOST),
    Mutant(
        "q.e4m3.inf_is_nan",
        QR,
        "code = tl.where(a > 0x7F800000, 0x7F, code)",
        "code = tl.where(a >= 0x7F800000, 0x7F, code)",
        Q_HOST,
        "satfinite sends +-inf to +-448; the mutant sends it to NaN",
    ),
    Mutant(
        "q.e4m3.subnormal",
        QR,
        "code_s = ((small * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)",
        "code_s = (small * 512.0).to(tl.int32)",
        Q_HOST,
        "truncates instead of RNE below 2^-6",
    ),
    Mutant(
        "bf16.rne", KS, "r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16", "r = (bits + 0x8000) >> 16", Q_HOST + OUT_TIES
    ),
    Mutant(
        "bf16.nan_quiet",
        KS,
        "(bits >> 16) | 0x40, r)",
        "(bits >> 16), r)",
        Q_HOST,
        "a NaN whose payload sits in the low 16 bits would become inf",
    ),
    Mutant(
        "bf16.widen",
        KS,
        "            x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)\n",
        "            x = x.to(tl.float32)\n",
        (QH + "test_bf16_subnormal_pe_exact_on_cpu", OUT + "test_bf16_subnormal_payloads_exact"),
    ),
    Mutant("q.rope.sign", QR, "    y0 = x0 * c - x1 * s\n", "    y0 = x0 * c + x1 * s\n", Q_HOST),
    Mutant(
        "q.rope.neox_pairs",
        QR,
        "    if NEOX:\n        x0, x1 = tl.split(tl.permute",
        "    if not NEOX:\n        x0, x1 = tl.split(tl.permute",
        Q_HOST,
    ),
    Mutant(
        "q.acks.never_wait",
        Q,
        "    ez = tl.load(last_z + p)\n    if ez > 0:",
        "    ez = tl.load(last_z + p)\n    if ez < 0:",
        Q_B2B,
    ),
    Mutant(
        "q.direct.one_slot",
        Q,
        "            slot = par\n        me = peer_pointer",
        "            slot = 0\n        me = peer_pointer",
        Q_B2B,
        "interpreter programs run one after another: only a call's first program can overrun a peer's last one",
        covered_by="q.direct.one_slot@gpu",
    ),
    # ---------------------------------------------------------------- GPU (--gpu): the races the interpreter hides
    Mutant(
        "q.direct.one_slot@gpu",
        Q,
        "            slot = par\n        me = peer_pointer",
        "            slot = 0\n        me = peer_pointer",
        (QG + "test_gpu_back_to_back_eager[triton]",),
        "the interpreter runs a grid's programs one after another, so only a call's first program can overrun a "
        "peer still in its last one; the CPU tests do not see it",
        gpu=True,
    ),
    Mutant(
        "cuda.query.one_slot",
        "csrc/query/direct.cu",
        "const int slot = MODE == kExposed ? kSlotZ : par;",
        "const int slot = MODE == kExposed ? kSlotZ : 0;",
        (QG + "test_gpu_back_to_back_eager[cuda]",),
        gpu=True,
    ),
    Mutant(
        "cuda.output.one_slot",
        "csrc/output/direct.cu",
        "  const int slot = static_cast<int>(e & 1);\n  const int64_t fv = call_flag(e, p.T);",
        "  const int slot = 0;\n  const int64_t fv = call_flag(e, p.T);",
        (
            "tests/test_output_gpu.py::test_direct_agrees_with_reference[cuda_plain-vmm]",
            "tests/test_output_gpu.py::test_10000_graph_replays_with_changing_inputs[cuda_plain-vmm]",
        ),
        "on one GPU shared by the ranks their kernels time-slice: a peer's combine is overrun only if it is preempted",
        gpu=True,
    ),
    # ---------------------------------------------------------------- protocol helpers and sentinel formats
    Mutant(
        "ks.epoch.plus_two",
        KS,
        "    e = tl.load(counter_ptr) + 1\n",
        "    e = tl.load(counter_ptr) + 2\n",
        TOPK_B2B + OUT_B2B,
        "+2 keeps every epoch on one parity: the one-slot race",
    ),
    Mutant(
        "ks.wait.no_error_word",
        KS,
        "    if ok == 0:\n        err = error_word(err_addr)",
        "    if ok == 2:\n        err = error_word(err_addr)",
        (
            TOPK + "test_missing_peer_raises_timeout",
            OUT + "test_missing_peer_raises_timeout",
            QH + "test_missing_peer_raises_timeout",
        ),
    ),
    Mutant(
        "mem.host.no_unlink",
        "peerdcp/memory/host.py",
        "    os.unlink(path)\n    linked = False\n",
        "    linked = False\n",
        (MEM + "test_200_cycles_leave_nothing",),
    ),
    Mutant(
        "mem.host.rollback_keeps_maps",
        "peerdcp/memory/host.py",
        "                _unmap(addr, size)\n",
        "                pass\n",
        (MEM + "test_failing_rank_rolls_back_everywhere",),
    ),
    Mutant(
        "mem.host.close_keeps_maps",
        "peerdcp/memory/host.py",
        "                _unmap(a, size)\n",
        "                pass\n",
        (MEM + "test_200_cycles_leave_nothing",),
    ),
    # ---------------------------------------------------------------- CUDA local candidate selection (one GPU)
    Mutant(
        "cuda.select.key.negzero",
        "csrc/topk/select.cu",
        "  if ((bits & 0x7fffffffu) == 0) bits = 0;                // -0 == +0\n",
        "",
        ("tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[ties-T3-L3000-k2048-W2r1I64]",),
        "-0 keeps score part 0x7fffffff (one below +0): only ties-T3-L3000 has the zeros inside the top n "
        "(inf, 2, 1, 0.5, +-0 ~1900 of 3000 keys < n = 2048)",
        gpu=True,
    ),
    Mutant(
        "cuda.select.gather.tie_id_flipped",
        "csrc/topk/select.cu",
        "if (v[e] == lo_f && row.id_part(row_of<VEC>(base, e)) >= lo_id) take |= 1u << e;",
        "if (v[e] == lo_f && row.id_part(row_of<VEC>(base, e)) <= lo_id) take |= 1u << e;",
        ("tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[equal-T2-L40000-k2048-W2r0I1]",),
        "the fast gather's id tie-break reversed: only the equal row without forced tokens gathers a tied score "
        "with lo_id != 0 (the radix select's prefix inside the id bits) on the fast path",
        gpu=True,
    ),
    Mutant(
        "cuda.select.gid.rank_not_interleaved",
        "csrc/topk/select.cu",
        "static_cast<int64_t>(l / I) * W * I + static_cast<int64_t>(rank) * I + l % I;",
        "static_cast<int64_t>(l / I) * W * I + static_cast<int64_t>(rank) + l % I;",
        (
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T3-L5000-k2048-W2r1I3]",
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[ties-T3-L3000-k2048-W2r1I64]",
        ),
        "gid's I > 1 branch (rank * I -> rank): every id part (and the forced windows) wrong where I > 1, rank > 0",
        gpu=True,
    ),
    Mutant(
        "cuda.select.radix.hist_counts_warp",
        "csrc/topk/select.cu",
        "if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));",
        "if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(act));",
        (
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T3-L131072-k2048-W1r0I1]",
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T4-L65536-k2048-W2r1I1]",
        ),
        "the row radix select's histogram adds the warp's matching lanes, not the bin's: the top bins are "
        "overcounted, P lands too high, the final gather holds < n keys (-1 in the output); only the radix path "
        "(select_radix_only=True, run for every case) reaches it",
        gpu=True,
    ),
    Mutant(
        "cuda.select.bucket.rank_skips_first_slot",
        "csrc/topk/select.cu",
        "for (int q = start[bk]; q < e; ++q) rank +=",
        "for (int q = start[bk] + 1; q < e; ++q) rank +=",
        (
            "tests/test_topk_local_gpu.py::test_gpu_select_poisoned_output_and_graph[1]",
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T3-L4096-k2048-W2r0I1]",
        ),
        "bucket_top's rank misses the bucket's first scattered key: in buckets of >= 2 keys two keys share a rank "
        "and one slot stays unwritten (normal rows put several keys in a bucket)",
        gpu=True,
    ),
    Mutant(
        "cuda.select.sort.no_register_swap_32",
        "csrc/topk/select.cu",
        "o[r] = j >= 32 ? v[r ^ (j >> 5)] : __shfl_xor_sync(0xffffffffu, v[r], j);",
        "o[r] = j > 32 ? v[r ^ (j >> 5)] : __shfl_xor_sync(0xffffffffu, v[r], j);",
        (
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T2-L20000-k2048-W1r0I1]",
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[ties-T3-L3000-k2048-W2r1I64]",
        ),
        "sort_desc's j = 32 step becomes a shuffle with lane mask 32 (own value): each warp's run of 64 is two "
        "sorted halves, the merges go wrong; only the bucket_top fallback (trim + sort_gathered) runs sort_desc "
        "(400 forced +inf keys > kMaxTopBucket; ties with > 256 +inf and > 128 per value)",
        gpu=True,
    ),
    Mutant(
        "cuda.select.funnel.offset_skips_cta0",
        "csrc/topk/select.cu",
        "for (int r = 0; r < c; ++r) off += sh.counts[r];",
        "for (int r = 1; r < c; ++r) off += sh.counts[r];",
        (
            "tests/test_topk_local_gpu.py::test_gpu_select_poisoned_output_and_graph[8]",
            "tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T3-L4096-k2048-W2r0I1]",
        ),
        "the funnel's offsets leave out CTA 0's count: CTA 1 overwrites CTA 0's keys, the tail of CTA 0's buf is "
        "stale (C > 1 only: ctas 8 in the poisoned test, ctas 2/3/8 in the reference test's loop)",
        gpu=True,
    ),
    Mutant(
        "cuda.select.pad.skips_first",
        "csrc/topk/select.cu",
        "for (int i = last + 1 + tid; i < n; i += kThreads) out[i] = -1;",
        "for (int i = last + 2 + tid; i < n; i += kThreads) out[i] = -1;",
        (
            "tests/test_topk_local_gpu.py::test_gpu_select_poisoned_output_and_graph[1]",
            "tests/test_topk_local_gpu.py::test_gpu_select_publish_equals_publish_kernel[2-0-7-5-1]",
        ),
        "bucket_top leaves out[count] unwritten on rows of fewer than n keys: only a poisoned output sees it "
        "(the reference test's outputs come from torch.empty)",
        gpu=True,
    ),
    Mutant(
        "cuda.select.forced.last_window",
        "csrc/topk/select.cu",
        "if (g < ff || g >= L - fl) bits = 0x7f800000u;",
        "if (g < ff || g > L - fl) bits = 0x7f800000u;",
        ("tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T5-L4097-k2048-W1r0I1]",),
        "the last forced window one token short: token L - fl (row 0, W = 1: local row 4094) loses its +inf",
        gpu=True,
    ),
    Mutant(
        "cuda.select.nloc.no_lmax_clamp",
        "csrc/topk/select.cu",
        "const int nloc = static_cast<int>(nl < a.Lmax ? nl : a.Lmax);",
        "const int nloc = static_cast<int>(nl);",
        (SEL_NEW + "[1-2048]", SEL_NEW + "[8-2048]"),
        "a row whose local share exceeds the width L (unchecked on CUDA tensors) read into the next row; no CASES "
        "entry has one (found by reading the kernel for this round): the test added for it",
        gpu=True,
    ),
    Mutant(
        "cuda.select.bucket.no_overflow_guard",
        "csrc/topk/select.cu",
        "if (h[e] > (2 * tid + e == 0 ? kMaxTopBucket : kMaxBucket)) overflow = 1;",
        "if (h[e] > (2 * tid + e == 0 ? kMaxTopBucket : kMaxBucket)) overflow = 0;",
        ("tests/test_topk_local_gpu.py::test_gpu_local_candidates_match_reference[normal-T2-L20000-k2048-W1r0I1]",),
        "equivalent in output: bucket_top's ranks are exact for buckets of any size (start + the bucket's larger "
        "keys; slots < 2^16); the guard only sends big buckets to the retry / fallback for speed",
        equivalent=True,
        gpu=True,
    ),
    Mutant(
        "cuda.select.fallback.pad",
        "csrc/topk/select.cu",
        "out[i] = i < valid ? buf[i] : -1;",
        "out[i] = i <= valid ? buf[i] : -1;",
        (SEL_NEW + "[1-2048]",),
        "the fallback's first -1 replaced by a stale key on rows of fewer than n keys that overflow the bucket map "
        "(1800 tied scores): no CASES entry pins such a row (the test added for it)",
        gpu=True,
    ),
    Mutant(
        "dist.agree.only_self",
        "peerdcp/_runtime/groups.py",
        "    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]\n    if bad:\n        detail",
        "    bad = [(r, m) for r, m in enumerate(msgs) if m is not None and r == info.rank]\n"
        "    if bad:\n        detail",
        (MEM + "test_failing_rank_rolls_back_everywhere",),
    ),
    Mutant(
        "dist.agree_or_release.no_close",
        "peerdcp/_runtime/groups.py",
        "            if buf is not None:\n                buf.close()",
        "            if buf is not None:\n                pass",
        (MEM + "test_failure_after_the_allocation_on_one_rank_is_agreed",),
    ),
    Mutant(
        "dist.collective.unbounded",
        "peerdcp/_runtime/groups.py",
        "work.wait(timeout=timedelta(seconds=timeout_s))",
        "work.wait()",
        (COLL + "test_missing_peer_raises_timeout_not_torch_wait[2-1-query]",),
    ),
    Mutant(
        "dist.collective.any_error_is_timeout",
        "peerdcp/_runtime/groups.py",
        "if work.is_completed() or time.monotonic() - start < timeout_s:",
        "if False:",
        (COLL + "test_peer_gone_raises_torch_error_at_once",),
    ),
    Mutant(
        "out.collective.no_record",
        "peerdcp/output/reducer.py",
        'mechanism="output")\n        except PeerTimeoutError as e:\n            self._failure = e\n',
        'mechanism="output")\n        except PeerTimeoutError as e:\n            pass\n',
        (COLL + "test_missing_peer_raises_timeout_not_torch_wait[2-1-output-a2a]",),
    ),
    Mutant(
        "q.collective.no_record",
        "peerdcp/query/gather.py",
        "self.timeout_s)\n        except PeerTimeoutError as e:\n            self._failure = e\n",
        "self.timeout_s)\n        except PeerTimeoutError as e:\n            pass\n",
        (COLL + "test_missing_peer_raises_timeout_not_torch_wait[2-1-query]",),
    ),
    Mutant(
        "topk.collective.no_record",
        S,
        'mechanism="topk",\n                )\n            except PeerTimeoutError as e:\n'
        "                self._failure = e\n",
        'mechanism="topk",\n                )\n            except PeerTimeoutError as e:\n                pass\n',
        (COLL + "test_missing_peer_raises_timeout_not_torch_wait[2-1-topk]",),
    ),
    Mutant("sentinel.out.torn_lse", SENT, " and a & _M32 == b & _M32:", ":", ("tests/test_sentinel_protocol.py",)),
    Mutant(
        "sentinel.out.half_check",
        SENT,
        "return all((w & 0xFFFF) != 0xFFFF and (w >> 16) & 0xFFFF != 0xFFFF for w in words)",
        "return all((w & 0xFFFF) != 0xFFFF for w in words)",
        ("tests/test_sentinel_protocol.py",),
        "equivalent under the format's premise (32-bit words are single-copy atomic, so a word is either at rest, "
        "0xFFFFFFFF, or fully written with no 0xFFFF half): one half decides",
        equivalent=True,
    ),
    # ------------------------------------------------------------------------- CUDA merge and scan (one GPU)
    Mutant(
        "cuda.merge.cutoff.lo_overshoots",
        MRG,
        "lo_sh[my] = h == 0 ? lo : lo + (h - 1) * step + 1;",
        "lo_sh[my] = h == 0 ? lo : lo + h * step;",
        (MT + "[2048-2]", MT + "[64-8]"),
        "the cut-off search's lower bound jumps past the last true probe: c_a overshoots by up to step - 1 "
        "(step > 1 once a list's interval is wider than kThreads / W lanes), keys of rank >= K are placed",
        gpu=True,
    ),
    Mutant(
        "cuda.merge.place_all.no_rank_bound",
        MRG,
        "if (pos < K) out[pos] = static_cast<int32_t>(2147483647 - (x & 2147483647));",
        "out[pos] = static_cast<int32_t>(2147483647 - (x & 2147483647));",
        (MT + "[64-2]", MT + "[2048-8]"),
        "place-all writes keys of rank >= K past the row (into the next row's positions)",
        gpu=True,
    ),
    Mutant(
        "cuda.merge.place_all.no_tail",
        MRG,
        "for (int i = (N < K ? N : K) + s * kThreads + tid; i < K; i += S * kThreads) out[i] = -1;",
        "for (int i = (N < K ? N : K) + s * kThreads + tid; i < K; i += S * kThreads) {}",
        (MT + "[7-2]", MT + "[2048-1]"),
        "place-all leaves the positions no key reaches unwritten (the poisoned 12345 shows where lists are short)",
        gpu=True,
    ),
    Mutant(
        "cuda.merge.valid.counts_tail",
        MRG,
        "const int n = peerdcp::count_greater(sh + tid * K, K, -1);",
        "const int n = peerdcp::count_greater(sh + tid * K, K, -2);",
        (MT + "[7-2]", MT + "[2048-3]"),
        "the -1 tail counts as valid keys: short lists place -1 keys as id 0 where the output must be -1",
        gpu=True,
    ),
    Mutant(
        "cuda.merge.direct.reads_other_slot",
        MRG,
        "src = a.lists + slot * a.slot_stride + b * a.list_stride + t * a.row_stride;",
        "src = a.lists + (a.direct ? slot ^ 1 : slot) * a.slot_stride + b * a.list_stride + t * a.row_stride;",
        (TG + "test_gpu_exact_selection_small_k[vmm-cuda]", TG + "test_gpu_back_to_back_without_barrier[vmm-cuda]"),
        "direct mode stages the peers' lists from the other parity slot (the previous call's candidates); the flag "
        "wait is unchanged, so only the values show it (multi-rank tests: PEERDCP_SHARED_GPU=1 on one GPU)",
        gpu=True,
    ),
    Mutant(
        "cuda.score.lens_always_int64",
        SC,
        "const int64_t L = p.lens64 ? static_cast<const int64_t*>(p.seq_lens)[t] : "
        "static_cast<const int32_t*>(p.seq_lens)[t];",
        "const int64_t L = static_cast<const int64_t*>(p.seq_lens)[t];",
        (ONE + "[cuda-64-0-1-int32]", ONE + "[cuda-20-3-6-int32]"),
        "int32 seq_lens read as int64 (two lengths fused; past the tensor at the last row): only the int32 cases "
        "pass int32 lengths to the CUDA scan",
        gpu=True,
    ),
    Mutant(
        "cuda.score.mask_one_past",
        SC,
        "if (l < Lmax) orow[r] = l < nloc ?",
        "if (l < Lmax) orow[r] = l <= nloc ?",
        (ONE + "[cuda-64-0-1-int64]",),
        "local row nloc (the first past the row's end) gets a score instead of -inf",
        gpu=True,
    ),
    Mutant(
        "cuda.score.page_of.table_width_ignored",
        SC,
        "const bool live = (p.table == nullptr || j < p.table_cols) && j < npg_row;",
        "const bool live = j < npg_row;",
        (ONE + "[cuda-64-0-1-int64]",),
        "pages past a narrow block table count as live (entry -1 clamps to page 0): scores where -inf is due",
        gpu=True,
    ),
    Mutant(
        "cuda.score.relu_missing_odd_heads",
        SC,
        "s0 += fmaxf(d[4 * k], 0.f) * wk.x + fmaxf(d[4 * k + 1], 0.f) * wk.y;",
        "s0 += fmaxf(d[4 * k], 0.f) * wk.x + d[4 * k + 1] * wk.y;",
        (ONE + "[cuda-64-0-1-int64]",),
        "the ReLU dropped for the odd heads of the thread's first row (r0)",
        gpu=True,
    ),
    Mutant(
        "cuda.score.sharded_uses_global_length",
        SC,
        "const int64_t nloc = p.sharded ? peerdcp::local_length(L, p.rank, p.W, p.I) : L;",
        "const int64_t nloc = L;",
        (ONE + "[cuda-64-0-1-int64]", TG + "test_gpu_cuda_scan_against_reference[64-1-0-1]"),
        "owner-sharded rows take the global length as their local one: equal at W = 1 (the one-rank test cannot see "
        "it); the multi-rank test (PEERDCP_SHARED_GPU=1) must",
        gpu=True,
    ),
    Mutant(
        "cuda.score.entry0_ignores_table",
        SC,
        "const int64_t entry0 = p.table == nullptr ? j0 : (j0 < p.table_cols ? p.table[t * p.table_stride + j0] : -1);",
        "const int64_t entry0 = j0;",
        (ONE + "[cuda-64-0-1-int64]",),
        "each CTA's first page (prefetched before the page numbers are shared) read from physical page j0, not the "
        "table's: rows of the second sequence score the first sequence's keys there",
        gpu=True,
    ),
    Mutant(
        "cuda.score.dead_page_not_masked",
        SC,
        "if (tid < kPage && j * kPage + tid < p.Lmax) orow[tid] = -__int_as_float(0x7f800000);",
        "if (tid < kPage && j * kPage + tid < p.Lmax) orow[tid] = 0.f;",
        (ONE + "[cuda-64-0-1-int64]",),
        "pages past the row's end score 0 instead of -inf",
        gpu=True,
    ),
    Mutant(
        "cuda.output.plain.no_payload_to_rank0",
        OD,
        "        if (pr.d[k] >= 0) {\n",
        "        if (pr.d[k] > 0) {\n",
        (OG + "test_direct_agrees_with_reference[cuda_plain-vmm]",),
        "the plain kernel never stores payload into rank 0's inbox: rank 0 combines stale rows",
        gpu=True,
    ),
    Mutant(
        "cuda.output.plain.own_lse_of_rank0",
        OD,
        "own_l[k] = __ldg(p.partial_lse + int64_t(item_t[k]) * W * H + rank * H + item_h[k]);",
        "own_l[k] = __ldg(p.partial_lse + int64_t(item_t[k]) * W * H + item_h[k]);",
        (OG + "test_direct_agrees_with_reference[cuda_plain-vmm]",),
        "the plain kernel weighs its own slice with rank 0's LSE (wrong on every rank > 0)",
        gpu=True,
    ),
    Mutant(
        "cuda.output.plain.publish_slot_fixed",
        OD,
        "const int64_t my_row0 = int64_t(slot * W + rank) * p.max_tokens;",
        "const int64_t my_row0 = int64_t(rank) * p.max_tokens;",
        (OG + "test_direct_agrees_with_reference[cuda_plain-vmm]",),
        "the plain kernel publishes into parity slot 0 at every call while the combine reads slot e & 1: every "
        "second call reads the slot of two calls ago",
        gpu=True,
    ),
    Mutant(
        "cuda.query.raw.prefetched_chunk_dropped",
        QD,
        "      if (tid + k * kThreads < n_raw) *reinterpret_cast<uint4*>(my_slot + pre_off[k]) = pre[k];",
        "      if (false) *reinterpret_cast<uint4*>(my_slot + pre_off[k]) = pre[k];",
        (QG + "test_gpu_each_path_T256_H32[cuda-raw]",),
        "raw publish drops the chunk it loaded before the epoch was known: peers read stale bf16 rows",
        gpu=True,
    ),
    Mutant(
        "cuda.query.units.block_drops_last_unit",
        QD,
        "const int u1 = min(u0 + a.upp, n_units);",
        "const int u1 = min(u0 + a.upp - 1, n_units);",
        (QG + "test_gpu_each_path_T256_H32[cuda-roped]",),
        "each block leaves its last unit (token, head) unwritten on every rank (the poisoned output shows it)",
        gpu=True,
    ),
    Mutant(
        "cuda.query.ll.consumer_skipped_at_w2",
        QD,
        "if (W > 1) copy_rows_ll(a, u0, u1, par, pub.f, osize);",
        "if (W > 2) copy_rows_ll(a, u0, u1, par, pub.f, osize);",
        (QG + "test_gpu_byte_identical_cuda_paths[vmm]",),
        "the LL consumer never copies the peers' rows at W = 2 (the matrix forces LL for its push path)",
        gpu=True,
    ),
    Mutant(
        "cuda.query.push.copies_from_peer_slots",
        QD,
        "copy_rows<MODE == kPush>(a, u0, u1, slot, ok_sh, osize);",
        "copy_rows<false>(a, u0, u1, slot, ok_sh, osize);",
        (QG + "test_gpu_byte_identical_cuda_paths[vmm]",),
        "the fenced push's consumer reads the peers' slots (the roped exchange's source) instead of the rows the "
        "peers stored into its own slot",
        gpu=True,
    ),
    Mutant(
        "cuda.query.pos.high_not_clamped",
        "csrc/query/params.cuh",
        "pp = pp < 0 ? 0 : (pp >= a.max_pos ? a.max_pos - 1 : pp);",
        "pp = pp < 0 ? 0 : pp;",
        (QG + "test_gpu_byte_identical_cuda_paths[vmm]",),
        "positions >= max_pos read past the cos/sin table (staged rows: every CUDA path on H200): only the oob "
        "cases send such positions",
        gpu=True,
    ),
    Mutant(
        "cuda.query.pos.low_not_clamped",
        "csrc/query/params.cuh",
        "pp = pp < 0 ? 0 : (pp >= a.max_pos ? a.max_pos - 1 : pp);",
        "pp = pp >= a.max_pos ? a.max_pos - 1 : pp;",
        (QG + "test_gpu_byte_identical_cuda_paths[vmm]",),
        "negative positions read before the cos/sin table: only the oob cases send them",
        gpu=True,
    ),
    Mutant(
        "cuda.query.pos.unstaged_not_clamped",
        "csrc/query/params.cuh",
        "p = p < 0 ? 0 : (p >= a.max_pos ? a.max_pos - 1 : p);",
        "p = p < 0 ? 0 : p;",
        (QG + "test_gpu_byte_identical_cuda_paths[vmm]",),
        "the unstaged cos/sin read (rope_dim > 256, or a block spanning > 8 tokens) without the high clamp: only the "
        "rope512-oob case reaches it",
        gpu=True,
    ),
)


def _shm_files() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")))


def run_tests(tree: Path, tests: tuple[str, ...], timeout: int) -> tuple[str, float, str]:
    """Run ``tests`` in ``tree``; host segments a mutant leaks (or a killed run leaves) are removed afterwards, so
    they cannot fail a later run's leak checks."""
    before = _shm_files()
    try:
        return _run_tests(tree, tests, timeout)
    finally:
        for f in _shm_files() - before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)


def _run_tests(tree: Path, tests: tuple[str, ...], timeout: int) -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), COLUMNS="400")  # (the summary line keeps its message)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", f"--timeout={timeout}", *tests]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout * 2 + 60)
    except subprocess.TimeoutExpired:
        return "killed(hang)", time.monotonic() - t0, "whole selection over its limit"
    dt = time.monotonic() - t0
    last = (p.stdout.strip().splitlines() or [""])[-1]
    if p.returncode == 0:
        return ("survived" if " passed" in last else "not run"), dt, last  # all skipped: says nothing
    if p.returncode == 1:  # (with the first failure's summary line: killed by an assertion, not by a build error)
        failed = [ln for ln in p.stdout.splitlines() if ln.startswith("FAILED ")]
        return "killed", dt, f"{last} | {failed[0][7:]}" if failed else last
    return f"error(rc={p.returncode})", dt, (p.stdout + p.stderr)[-400:]


_BUILD = """
import sys
from peerdcp._runtime import jit
mutated = sys.argv[1]
for name, (sources, flags) in jit.LIBRARIES.items():
    if mutated.endswith(".cuh") or mutated in sources:
        print(jit._ensure_built(name, sources, jit._flags(flags)))
"""


def prebuild(tree: Path, todo: list[Mutant], cache: Path) -> int:
    """Build, for every mutant of a ``csrc/`` file, the libraries that compile it (a ``.cuh``: all of them) into
    ``cache``; exit 1 if one does not build (a mutant that does not compile says nothing)."""
    failed = 0
    for m in (m for m in todo if m.path.startswith("csrc/")):
        f = tree / m.path
        orig = f.read_text()
        env = dict(os.environ, PYTHONPATH=str(tree), PEERDCP_CACHE=str(cache))
        t0 = time.monotonic()
        try:
            f.write_text(orig.replace(m.old, m.new))
            cmd = [sys.executable, "-c", _BUILD, Path(m.path).name]
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        finally:
            f.write_text(orig)
        ok = p.returncode == 0
        failed += not ok
        print(f"{m.name:32s} {'built' if ok else 'BUILD FAILED':14s} {time.monotonic() - t0:6.0f} s", flush=True)
        if not ok:
            print((p.stdout + p.stderr)[-2000:])
    for o in cache.rglob("*.o"):  # (objects: not needed to load, 10x the library's size)
        o.unlink()
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, required=True, help="a separate checkout to mutate (never the working one)")
    ap.add_argument("--only", nargs="*", help="mutant names (prefix match)")
    ap.add_argument("--timeout", type=int, default=240, help="pytest-timeout per test, seconds")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--gpu", action="store_true", help="the GPU mutants (on a GPU machine) instead of the CPU ones")
    ap.add_argument("--prebuild", type=Path, help="build the csrc mutants' libraries into this cache; run nothing")
    args = ap.parse_args()
    tree = args.tree.resolve()
    if tree == Path(__file__).resolve().parents[2]:
        ap.error("--tree must be a separate checkout: mutants are written into it")
    todo = [m for m in MUTANTS if m.gpu == args.gpu and (not args.only or any(m.name.startswith(o) for o in args.only))]
    for m in todo:  # every mutant must apply before anything runs
        n = (tree / m.path).read_text().count(m.old)
        if n != 1:
            raise SystemExit(f"{m.name}: the text to replace occurs {n} times in {m.path}")
    if args.prebuild:
        return prebuild(tree, todo, args.prebuild.resolve())
    if not args.no_baseline:
        sel = tuple(dict.fromkeys(t for m in todo for t in m.tests))
        status, dt, last = run_tests(tree, sel, args.timeout)
        print(f"baseline ({len(sel)} selections): {status} in {dt:.0f} s: {last}", flush=True)
        if status != "survived":
            raise SystemExit("the unmutated tree fails its tests: fix that first")
    rows = []
    for m in todo:
        f = tree / m.path
        orig = f.read_text()
        try:
            f.write_text(orig.replace(m.old, m.new))
            status, dt, last = run_tests(tree, m.tests, args.timeout)
        finally:
            f.write_text(orig)
        rows.append({**asdict(m), "status": status, "seconds": round(dt, 1), "last": last})
        print(f"{m.name:32s} {status:14s} {dt:6.0f} s  {last[:200]}", flush=True)
    killed = sum(r["status"].startswith("killed") for r in rows)
    print(f"\n{killed} of {len(rows)} mutants killed")
    bad = []
    for r in rows:
        dead = r["status"].startswith("killed")
        if dead and r["equivalent"]:
            bad.append(r)
            print(f"  killed, but listed as equivalent (the note is wrong): {r['name']}")
        elif not dead:
            if not (r["equivalent"] or r["covered_by"]):
                bad.append(r)
            kind = "equivalent" if r["equivalent"] else "NOT EQUIVALENT: a missing test"
            kind = f"killed on GPU as {r['covered_by']}" if r["covered_by"] else kind
            print(f"  {r['status']} ({kind}): {r['name']} ({r['path']}) {r['note']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
