"""CPU checks of sm90_bwd's schedule flags (issue 14, FlashAttention-3's backward schedule):

* overlap_sdp: dPᵀ = V_j dO_iᵀ issued right behind Sᵀ = K_j Q_iᵀ (two commit groups), only Sᵀ
  waited for (wgmma_wait<1>) before Pᵀ is computed, dPᵀ waited for after dV is issued;
* dq_writer: the consumers stage dQ_i's part (fp32, BM x head_dim, 128-byte swizzled 32-column
  boxes) in shared memory, and warp 1 of the producer warpgroup adds it to the accumulator by
  tensor bulk reduce-adds (tma_dq), double-buffered where it fits.

Config fields, names, template arguments (appended last), the space, the rules (deterministic,
dq_bulk, the combinations whose kernels spill), shared memory against the kernel's own constants
(nvcc), the per-call tensor map of the accumulator, the kernel's ordering of waits and barriers,
and the nvcc/ptxas build (zero spills, no "wgmma serialized") of every new instantiation class.
No GPU needed.
"""
import itertools
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cuflash import launch, registry
from cuflash.compile import kernel_dir, nvcc_compile
from cuflash.families import sm90_bwd, sm90_fwd
from cuflash.families.base import ConfigError
from cuflash.families.sm90_bwd import HEAD_DIMS, MAX_SMEM, Sm90BwdConfig, dq_accum_map_args
from cuflash.problem import DTYPES, Problem

from test_sm90_bwd_cpu import fake_launches  # noqa: E402
from test_sm90_cpu import serialized  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")


def problem(head_dim=128, dtype="bf16", causal=False, deterministic=False, **kw):
    shape = dict(batch=2, seqlen_q=300, seqlen_k=200, nheads=8, nheads_kv=2)
    shape.update(kw)
    return Problem("bwd", dtype, shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                   shape["nheads"], shape["nheads_kv"], head_dim, causal, deterministic)


def base(d=128, dtype="bf16", causal=False, **kw):
    """The heuristic's tile at head dim d (BM 64; BN 64 / 1 consumer at d64, 128 / 2 at d128)."""
    return Sm90BwdConfig(64, 64 * (d // 64), 2, d // 64, d, dtype, causal, **kw)


def compile_clean(configs):
    """nvcc -cubin sm_90a of `configs` on 2 threads: the ones with spills, stack or serialized
    wgmma, as lines."""
    chunks = [configs[i::2] for i in range(2) if configs[i::2]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda c: list(zip(c, nvcc_compile(c, "sm_90a", NVCC))), chunks))
    return [f"{c.name}: {r}" for rs in done for c, r in rs
            if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r)]


# ---------------------------------------------------------------------------------------
# config, names, template, space

def test_fields_names_template_args():
    plain = base()
    ovl, dqw = plain.replace(overlap_sdp=True), plain.replace(dq_writer=True)
    both = ovl.replace(dq_writer=True)
    assert ovl.name == plain.name + "_ovl" and dqw.name == plain.name + "_dqw"
    assert both.name == plain.name + "_ovl_dqw"
    assert plain.replace(softcap=True, dq_writer=True).name.endswith("_cap_dqw")
    # appended last: the plain config keeps its name expression (and so its code)
    assert plain.kernel_name() == "cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, false, false>"
    assert ovl.kernel_name() == ("cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, false, false, "
                                 "false, false, false, false, false, true, false>")
    assert dqw.kernel_name().endswith("false, false, false, false, false, false, true>")
    assert both.replace(alibi=True).kernel_name().endswith("false, false, true, false, false, true, true>")
    assert plain.replace(dq_bulk=True).kernel_name().endswith("false, false, false, false, true>")
    assert len(both.template_args()) >= 19 and both.template_args()[13:15] == (True, True)  # (kVarlen .. kDsDouble last)
    assert plain.template_args()[13:15] == (False, False)
    for cfg in (ovl, dqw, both):
        assert cfg.problems() == [] and FAM.decode(FAM.encode(cfg), "bf16", False) == cfg


def test_space_and_heuristic():
    assert FAM.space["overlap_sdp"] == (False, True) and FAM.space["dq_writer"] == (False, True)
    assert list(FAM.space)[5:9] == ["overlap_sdp", "dq_writer", "dynamic", "ds_double"]
    for d, causal, det in itertools.product(HEAD_DIMS, (False, True), (False, True)):
        p = problem(d, causal=causal, deterministic=det)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        # measured: dq_writer on wherever the call allows it (not deterministic); overlap_sdp off
        # (head dim 256: red.add until HEURISTIC_D256_DQ_WRITER, dq_writer staging in the ring slot)
        d256_dqw = d < 256 or sm90_bwd.HEURISTIC_D256_DQ_WRITER
        assert not cfg.overlap_sdp and cfg.dq_writer == (not det and d256_dqw) and not cfg.problems()
        valid = FAM.valid(p, MAX_SMEM)
        assert all(FAM.for_problem(c, p).problems() == [] for c in valid)
        if not det and d256_dqw:   # the unordered calls have dq_writer points (d256: while it is tunable)
            assert any(c.dq_writer for c in valid)
        assert any(c.overlap_sdp for c in valid)


def test_rules_and_for_problem():
    dqw = base(dq_writer=True)
    with pytest.raises(ConfigError, match="dq_writer with deterministic"):
        dqw.replace(deterministic=True).validate()
    with pytest.raises(ConfigError, match="dq_writer with dq_bulk"):
        dqw.replace(dq_bulk=True).validate()
    # d128 dropout: dq_writer is its dQ path without softcap / ALiBi (dropout_dq_path), the
    # consumers' red.add is refused (ptxas spills it)
    assert dqw.replace(dropout=True).problems() == []
    with pytest.raises(ConfigError, match="dropout at head_dim=128 takes dq_bulk"):
        dqw.replace(dropout=True, alibi=True).validate()
    with pytest.raises(ConfigError, match="dropout at head_dim=128 takes dq_writer"):
        base(dropout=True).validate()
    assert base(64, dq_writer=True, dropout=True).problems() == []
    # overlap_sdp at d128: plain, causal and window (softcap, ALiBi, dropout spill)
    ovl = base(overlap_sdp=True)
    assert ovl.problems() == [] and ovl.replace(window=True).problems() == []
    assert ovl.replace(window=True, causal=True).problems() == [] and ovl.replace(causal=True).problems() == []
    for change in (dict(softcap=True), dict(alibi=True), dict(dropout=True)):
        assert any("overlap_sdp at head_dim=128" in w for w in ovl.replace(**change).problems()), change
    for change in (dict(causal=True), dict(softcap=True), dict(alibi=True), dict(dropout=True)):
        assert base(64, overlap_sdp=True, **change).problems() == [], change
    # the call decides: a deterministic call drops dq_writer, d128 dropout keeps it; overlap_sdp
    # goes where its kernel would spill; otherwise the flags stay
    both = base(overlap_sdp=True, dq_writer=True)
    assert FAM.for_problem(both, problem()) == both
    det = FAM.for_problem(both, problem(deterministic=True))
    assert det.deterministic and not det.dq_writer and det.overlap_sdp and det.problems() == []
    cap = FAM.for_problem(both, problem().replace(features=("softcap",), softcap=30.0))
    assert cap.softcap and cap.dq_writer and not cap.overlap_sdp and cap.problems() == []
    drop = FAM.for_problem(both, problem().replace(features=("dropout",), dropout_p=0.1))
    assert drop.dropout and drop.dq_writer and not drop.overlap_sdp and drop.problems() == []
    d64 = base(64, overlap_sdp=True, dq_writer=True)
    p64 = problem(64, causal=True).replace(features=("dropout",), dropout_p=0.1)
    assert FAM.for_problem(d64, p64).dq_writer and FAM.for_problem(d64, p64).overlap_sdp


def test_smem_bytes_and_buffers():
    plain = base()
    dqw = plain.replace(dq_writer=True)
    tile = 64 * 128 * 4
    # past the mbarriers, 1024-byte aligned; two tiles at stages 2, one at stages 3
    assert dqw.dq_writer_bufs == 2 and plain.dq_writer_bufs == 0
    assert dqw.smem_bytes == -(-(plain.smem_bytes - 1024) // 1024) * 1024 + 2 * tile + 1024
    s3 = dqw.replace(stages=3)
    assert s3.dq_writer_bufs == 1 and s3.problems() == []
    assert s3.smem_bytes == -(-(s3.replace(dq_writer=False).smem_bytes - 1024) // 1024) * 1024 + tile + 1024
    cap = dqw.replace(softcap=True)     # past the thread words; exactly the 227 KB
    assert cap.dq_writer_bufs == 2 and cap.smem_bytes <= MAX_SMEM and cap.problems() == []
    d64 = base(64, dq_writer=True)
    assert d64.dq_writer_bufs == 2 and d64.smem_bytes < 100 * 1024
    assert all(c.smem_bytes <= MAX_SMEM for c in FAM.valid(problem(), MAX_SMEM))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_smem_matches_the_kernel(tmp_path):
    """smem_bytes and dq_writer_bufs are the kernel's Sm90BwdDqWriterStage constants, as nvcc
    computes them."""
    configs = [base(dq_writer=True), base(causal=True, dq_writer=True).replace(stages=3),
               base(64, dq_writer=True), base(softcap=True, alibi=True, dq_writer=True),
               base(64, softcap=True, dropout=True, dq_writer=True),
               base(64, dropout=True, dq_writer=True).replace(stages=3)]
    exprs = []
    for c in configs:
        shape = f"cuflash::Sm90BwdShape<{c.BM}, {c.BN}, {c.stages}, {c.consumers}, {c.head_dim}>"
        words = f"cuflash::Sm90BwdThreadWords<{shape}, {c.consumers}, {(int(c.softcap) + int(c.dropout)) * c.BM // 4}>"
        stage = f"cuflash::Sm90BwdDqWriterStage<{words}, {c.BM}, {c.head_dim}>"
        exprs += [f"{stage}::kSmemBytes", f"{stage}::kBufs", f"{stage}::kOffset % 1024"]
    src = tmp_path / "stage.cu"
    src.write_text('#include "sm90_bwd.cu"\n#include <cstdio>\nint main() {\n'
                   + "".join(f'  std::printf("%d\\n", int({e}));\n' for e in exprs) + "}\n")
    exe = tmp_path / "stage"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-I", str(kernel_dir()), "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == [v for c in configs for v in (c.smem_bytes, c.dq_writer_bufs, 0)]


# ---------------------------------------------------------------------------------------
# the accumulator's tensor map

def test_dq_accum_map_args():
    args = dq_accum_map_args(0x7000, (16, 384, 128), 64)
    assert args[0] == 7                                        # CU_TENSOR_MAP_DATA_TYPE_FLOAT32
    assert args[1:5] == (0x7000, (128, 384, 16), (128 * 4, 384 * 128 * 4), (32, 64, 1))
    assert args[5:] == (sm90_fwd.SWIZZLE_128B, sm90_fwd.L2_PROMOTION_128B, sm90_fwd.OOB_FILL_ZEROS)


@pytest.mark.parametrize("dq_writer", [False, True], ids=["red_add", "dq_writer"])
def test_plan_writes_the_dq_map(monkeypatch, dq_writer):
    calls = []

    def encode(*args):
        calls.append(args)
        return bytes((len(calls) + j) % 256 for j in range(128))

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    monkeypatch.setattr(sm90_fwd, "_MAP_CACHE", {})
    dt, launches = fake_launches(monkeypatch)
    p = problem(128, "bf16", False)
    # (the plain grid: the dynamic scheduler's plan zeroes a counter on the GPU)
    cfg = FAM.heuristic(p).replace(dq_writer=dq_writer, dynamic=False)
    st_q, st_k = (300 * 8 * 128, 8 * 128, 128, 1), (200 * 2 * 128, 2 * 128, 128, 1)
    strides = {"dout": st_q, "q": st_q, "k": st_k, "v": st_k, "o": st_q, "dq": st_q, "dk": st_k, "dv": st_k}
    plan = launch.Plan(FAM, cfg, p, strides, 0.125, 0)
    ws = FAM.workspace(cfg, p, strides)
    ptrs = tuple(0x10000 * (i + 1) for i in range(9))
    plan.run(ptrs, 0x1000000, stream=7)
    main = launches[1]
    assert main["smem"] == cfg.smem_bytes
    rec = np.frombuffer(main["raw"], dt)[0]
    off = dt.fields["tma_dq"][1]
    if not dq_writer:
        assert len(calls) == 4 and main["raw"][off:off + 128] == bytes(128)
        return
    assert len(calls) == 5
    assert calls[4] == dq_accum_map_args(0x1000000 + ws["dq_accum"], (2 * 8, 384, 128), cfg.BM)
    assert int(rec["dq_accum"]) == 0x1000000 + ws["dq_accum"]
    assert main["raw"][off:off + 128] == bytes((5 + j) % 256 for j in range(128))
    plan.run(ptrs, 0x1000000, stream=7)                        # same pointers: cached maps
    assert len(calls) == 5
    plan.run(ptrs, 0x2000000, stream=7)                        # a new workspace: a new dq map
    assert len(calls) == 6 and calls[5][1] == 0x2000000 + ws["dq_accum"]


# ---------------------------------------------------------------------------------------
# the kernel source: flags last, the order of waits and barriers

def _after(body, order):
    pos = 0
    for token in order:
        pos = body.index(token, pos) + 1


def test_kernel_source_order():
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "bool kDqBulk = false, bool kOverlapSdp = false, bool kDqWriter = false,\n          bool kVarlen = false, bool kLpt = false, bool kDynamic = false, bool kDsDouble = false," in src
    # overlap_sdp: Sᵀ committed, dPᵀ issued and committed, wait for 1 pending (Sᵀ), Pᵀ; dV issued
    # after a wgmma fence, then wait<1> (dPᵀ) before dSᵀ
    loop = src[src.index("auto issue_s = [&](int s_slot) {"):]   # (Sᵀ's GEMM: before the Q-block loop)
    _after(loop, ["wgmma_fence()", "wgmma_commit()", "if constexpr (kOverlapSdp)", "reg_fence(dp_flat)",
                  "v_rows_desc", "wgmma_commit()", "wgmma_wait<1>()", "reg_fence(s_flat)",
                  "pack_a_frags<1, kSN / 16, Elem>(p_frag", "wgmma_fence()", "do_t_desc", "wgmma_commit()",
                  "wgmma_wait<1>()", "reg_fence(dp_flat)"])
    # dq_writer, consumers: wait for the tile (from the kBufs-th block on), store, fence, signal
    body = src[src.index("if constexpr (kDqWriter) {\n                // to tile"):]
    _after(body, ["named_barrier_sync(kDqEmptyBar + buf, kDqBarThreads)", "float2",
                  "fence_proxy_async_smem()", "named_barrier_arrive(kDqFullBar + buf, kDqBarThreads)",
                  "continue;"])
    # the writer warp: wait for the tile, the bulk ops, commit, wait until read, release; at the
    # end wait for the whole operation
    writer = src[src.index("if (kDqWriter && tid / 32 == 1 && (kDynamic || kDqConvert || n_iters > 0)) {"):]
    _after(writer, ["named_barrier_sync(kDqFullBar + buf, kDqBarThreads)", "bulk_reduce_add_tensor_3d(",
                    "bulk_commit_group()", "bulk_wait_group_read<0>()", "__syncwarp()",
                    "if (!kSlotDq && !kDynamic && it + DqW::kBufs < n_iters)",
                    "named_barrier_arrive(kDqEmptyBar + buf",
                    "bulk_wait_group<0>()", "} else if (tid < 32 && (kDynamic || n_iters > 0)) {"])
    assert "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group" in \
        (kernel_dir() / "ptx_sm90_bulk.cuh").read_text()
    assert "TmaDesc tma_dq;" in (kernel_dir() / "params_sm90_bwd.cuh").read_text()


# ---------------------------------------------------------------------------------------
# ptxas

@needs_nvcc
def test_ptxas_schedule_flags_no_spills_no_serialized_wgmma():
    """d64 / d128 x causal / not x bf16 / fp16 x {overlap_sdp, dq_writer, both}, plus stages 3:
    zero spills, no stack, no serialized wgmma (26 instantiations, a minute or two on 2 cores)."""
    configs = []
    for d, causal, dtype in itertools.product(HEAD_DIMS, (False, True), DTYPES):
        for flags in (dict(overlap_sdp=True), dict(dq_writer=True), dict(overlap_sdp=True, dq_writer=True)):
            cfg = base(d, dtype, causal, **flags)
            if not cfg.problems():
                configs.append(cfg)
    configs += [base(128, overlap_sdp=True, dq_writer=True).replace(stages=3),
                base(128, causal=True, overlap_sdp=True, dq_writer=True).replace(stages=3)]
    assert len(configs) == 26 and all(c.problems() == [] for c in configs)
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)


@needs_nvcc
def test_ptxas_schedule_flags_with_features_no_spills():
    """The flags with the feature kernels where they are allowed: window (+ overlap_sdp at d128),
    softcap + ALiBi + window and dropout with dq_writer, everything at d64 (10 instantiations)."""
    configs = [base(128, overlap_sdp=True, window=True), base(128, causal=True, overlap_sdp=True, window=True),
               base(128, dq_writer=True, window=True, softcap=True, alibi=True),
               base(128, causal=True, dq_writer=True, softcap=True),
               base(128, overlap_sdp=True, dq_writer=True, window=True),
               base(64, dq_writer=True, dropout=True), base(64, causal=True, overlap_sdp=True, dropout=True),
               base(64, causal=True, overlap_sdp=True, dq_writer=True, window=True, softcap=True, alibi=True),
               base(64, overlap_sdp=True, dq_writer=True, softcap=True, dropout=True),
               base(64, "fp16", True, overlap_sdp=True, dq_writer=True, alibi=True)]
    assert all(c.problems() == [] for c in configs), [c.problems() for c in configs]
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)


def test_thread_words_word_major():
    """softcap's / dropout's per-thread words (Sm90BwdThreadWords) are word-major: word w of
    consumer thread c at (w · consumer threads + c) · 4, a warp's 32 accesses to one word in 32
    banks (the layout only; test_sm90_bwd_features_gpu.py checks softcap and dropout on the GPU)."""
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "words_smem_ptr = smem_ptr + Words::kOffset + (tid - 128) * 4;" in src
    assert "return *reinterpret_cast<u32*>(words_smem_ptr + w * kConsumerThreads * 4);" in src


@pytest.mark.parametrize("cfg", [base(d, dq_writer=True) for d in HEAD_DIMS]
                         + [Sm90BwdConfig(64, 128, 2, 2, 64, "bf16", False, dq_writer=True),     # 32 columns a wg
                            Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False, dq_writer=True)],   # 64 rows a wg
                         ids=lambda c: c.name)
def test_dq_writer_stores_are_the_tma_swizzle(cfg):
    """The consumers' fragment stores into the staging tile (sm90_bwd.cu, kDqWriter: the base
    pointer, (nt / 4) boxes on, the unit 2·(nt % 4) ^ (t / 2 ^ g), 8 rows per half) put element
    (row, col) of the BM x head_dim part where the tensor map's 128B swizzle reads it (box col /
    32, row, 16-byte unit (col % 32) / 4 ^ row % 8), every element exactly once; a half warp's
    float2 stores conflict at most 2-way."""
    d = cfg.head_dim
    BM, box = cfg.BM, cfg.BM * 128
    row_groups = BM // 64
    col_groups = cfg.consumers // row_groups
    dq_n = d // col_groups
    assert dq_n == cfg.dq_cols
    seen = {}
    for wg in range(cfg.consumers):
        row_group, col0 = wg % row_groups, (wg // row_groups) * dq_n
        for warp, lane in itertools.product(range(4), range(32)):
            g, t = lane // 4, lane % 4
            tile = (col0 // 32) * box + (row_group * 64 + warp * 16 + g) * 128 + (t % 2) * 8
            sw = ((t // 2) ^ g) << 4
            for nt, half in itertools.product(range(dq_n // 8), range(2)):
                off = tile + (nt // 4) * box + (sw ^ ((2 * (nt % 4)) << 4)) + half * 8 * 128
                row, col = row_group * 64 + warp * 16 + g + 8 * half, col0 + nt * 8 + 2 * t
                for e in range(2):
                    want = (col + e) // 32 * box + row * 128 + ((((col + e) % 32) // 4) ^ (row % 8)) * 16 + (col + e) % 4 * 4
                    assert off + 4 * e == want, (wg, warp, lane, nt, half, e)
                    seen[want] = seen.get(want, 0) + 1
                if lane < 16 and warp == 0 and wg == 0 and half == 0:   # one store instruction's half warp
                    seen.setdefault(("banks", nt), []).append((off // 4) % 32)
    offsets = [k for k in seen if not isinstance(k, tuple)]
    assert sorted(offsets) == list(range(0, BM * d * 4, 4)) and all(seen[k] == 1 for k in offsets)
    for key, banks in seen.items():
        if isinstance(key, tuple):   # 16 threads x 2 words: each bank at most twice
            words = [b + e for b in banks for e in range(2)]
            assert max(words.count(b) for b in set(words)) <= 2
