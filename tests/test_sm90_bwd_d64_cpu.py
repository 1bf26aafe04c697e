"""CPU checks of sm90_bwd's head-dim-64 tiles with two consumer warpgroups (issue 14):

* BM64 BN128 c2: the d128 shape at d64; dQ_i (64 x 64) split by head-dim halves, 32 columns
  per warpgroup (kDqN = 32: wgmma m64n32k16, K_j's B operand starting 64 bytes into its
  128-byte swizzled rows);
* BM128 BN128 c2: FlashAttention-3's d64 tile; dQ_i split by rows (64 per warpgroup). Its
  accum_regs sum is over MAX_ACCUM_REGS, ptxas fits it (PTXAS_FITS); not with dropout (a
  thread's keep bits of Pᵀ are one 32-bit word).

Config rules, names, shared memory, the space, for_problem's fixes, the one-line switches
(D64_ABOVE_FA2, D64_SHAPE), the kernel source, and nvcc -cubin sm_90a of the new
instantiations with the schedule and feature flags: zero spills, no stack, no serialized
wgmma. (The plain, deterministic and dq_bulk points of the space compile in
test_sm90_bwd_cpu.py's every-valid-config test.) No GPU needed.
"""
import itertools
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuflash import registry
from cuflash.compile import kernel_dir, nvcc_compile
from cuflash.families import sm90_bwd
from cuflash.families.base import ConfigError
from cuflash.families.sm90_bwd import MAX_ACCUM_REGS, PTXAS_FITS, Sm90BwdConfig
from cuflash.problem import Problem
from cuflash.select import choose

from test_sm90_cpu import serialized  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")
MAX_SMEM = 227 * 1024

HALVES = Sm90BwdConfig(64, 128, 2, 2, 64, "bf16", False)     # dQ by 32-column halves
FA3 = Sm90BwdConfig(128, 128, 2, 2, 64, "bf16", False)       # dQ by 64-row halves
NEW_TILES = (HALVES, FA3)


def problem(head_dim=64, dtype="bf16", causal=False, deterministic=False, features=(), **kw):
    p = Problem("bwd", dtype, 2, 300, 200, 8, 2, head_dim, causal, deterministic)
    return p.replace(features=tuple(features), **kw) if features or kw else p


def test_new_tiles_are_valid_with_their_dq_split():
    assert HALVES.problems() == [] and FA3.problems() == []
    assert HALVES.dq_cols == 32 and FA3.dq_cols == 64
    assert HALVES.name == "sm90bwd_bf16_d64_full_BM64_BN128_s2_c2"
    assert FA3.replace(causal=True, dq_writer=True).name == "sm90bwd_bf16_d64_causal_BM128_BN128_s2_c2_dqw"
    assert HALVES.kernel_name() == "cuflash::sm90_bwd<64, 128, 2, 2, 64, cuflash::bf16, false, false>"
    # K, V 16 KB each; 2 x (Q, dO) 8 KB each; dS 64 x 128; LSE, D; barriers; alignment
    assert HALVES.smem_bytes == 2 * 16384 + 4 * 8192 + 16384 + 4 * 256 + 8 * 5 + 1024
    assert FA3.smem_bytes == 2 * 16384 + 4 * 16384 + 32768 + 4 * 512 + 8 * 5 + 1024
    # BM 128: over the accumulator sum, but a shape ptxas fits
    assert FA3.accum_regs > MAX_ACCUM_REGS and FA3.shape in PTXAS_FITS
    assert HALVES.accum_regs == 64 + 64 + 32 + 16
    # the dq_writer staging: 2 tiles of 128 x 64 fp32 at stages 2, one at stages 3
    assert FA3.replace(dq_writer=True).dq_writer_bufs == 2
    assert FA3.replace(dq_writer=True, stages=3).dq_writer_bufs == 1
    assert HALVES.replace(dq_bulk=True).dq_stage_bytes == 2 * 64 * (32 + 8) * 4


def test_rules_of_the_new_tiles():
    with pytest.raises(ConfigError, match="dropout with BM=128"):
        FA3.replace(dropout=True).validate()
    with pytest.raises(ConfigError, match="dq_bulk with dropout and 2 consumers"):
        HALVES.replace(dropout=True, dq_bulk=True).validate()
    assert HALVES.replace(dropout=True).problems() == []
    assert HALVES.replace(dropout=True, dq_writer=True, overlap_sdp=True).problems() == []
    assert Sm90BwdConfig(64, 64, 2, 1, 64, "bf16", False, dropout=True, dq_bulk=True).problems() == []
    # BM 128: what ptxas spills (bm128_spills) is refused; for_problem moves such calls
    for f in (dict(softcap=True), dict(alibi=True), dict(overlap_sdp=True, window=True, dq_writer=True),
              dict(overlap_sdp=True, stages=3, dq_writer=True), dict(overlap_sdp=True)):
        with pytest.raises(ConfigError, match="BM=128 with softcap"):
            FA3.replace(**f).validate()
    assert FA3.replace(overlap_sdp=True, dq_writer=True).problems() == []
    assert FA3.replace(window=True, dq_writer=True, stages=3).problems() == []
    # PTXAS_FITS lifts the sum rule for that shape only: BM 128 at d128 stays refused
    assert Sm90BwdConfig(128, 128, 2, 2, 128, "bf16", False).problems()
    assert Sm90BwdConfig(64, 64, 2, 1, 128, "bf16", False).problems()


def test_for_problem_fixes_the_call():
    drop = problem(features=("dropout",), dropout_p=0.1)
    cfg = FAM.for_problem(FA3.replace(dq_writer=True), drop)
    assert (cfg.BM, cfg.BN, cfg.consumers) == (64, 128, 2) and cfg.dropout and cfg.dq_writer
    assert cfg.problems() == []
    cfg = FAM.for_problem(HALVES.replace(dq_bulk=True), drop)
    assert cfg.dropout and not cfg.dq_bulk and cfg.problems() == []
    # without dropout the tile stays
    assert FAM.for_problem(FA3, problem()) == FA3
    # softcap: BM 64; a window with overlap_sdp: overlap_sdp dropped, BM 128 kept
    cap = problem(features=("softcap",), softcap=30.0)
    cfg = FAM.for_problem(FA3.replace(overlap_sdp=True, dq_writer=True), cap)
    assert (cfg.BM, cfg.softcap, cfg.overlap_sdp, cfg.dq_writer) == (64, True, True, True) and cfg.problems() == []
    win = problem(causal=True, features=("window",), window=(64, 0))
    cfg = FAM.for_problem(FA3.replace(overlap_sdp=True, dq_writer=True), win)
    assert (cfg.BM, cfg.window, cfg.overlap_sdp, cfg.dq_writer) == (128, True, False, True) and cfg.problems() == []
    # deterministic drops dq_writer, and with it overlap_sdp at BM 128
    cfg = FAM.for_problem(FA3.replace(overlap_sdp=True, dq_writer=True), problem(deterministic=True))
    assert (cfg.BM, cfg.overlap_sdp, cfg.dq_writer) == (128, False, False) and cfg.problems() == []


def test_space_at_d64_has_the_new_tiles():
    for causal, det in itertools.product((False, True), (False, True)):
        p = problem(causal=causal, deterministic=det)
        valid = FAM.valid(p, MAX_SMEM)
        tiles = {(c.BM, c.BN, c.consumers) for c in valid}
        assert tiles == {(64, 64, 1), (64, 128, 2), (128, 128, 2)}
        assert all(FAM.for_problem(c, p).problems() == [] for c in valid)
        if not det:
            assert any(c.dq_writer and c.BM == 128 for c in valid)
            assert any(c.dq_writer and c.dq_cols == 32 for c in valid)


def test_one_line_switches(monkeypatch):
    """D64_ABOVE_FA2 ranks the family first at head dims <= 64, D64_SHAPE picks the heuristic's
    tile there, D96_ABOVE_FA2 ranks it first at 65..96; as measured on the H100: on, BM128 BN128
    c2, on. Off: fa2_bwd first, as before the 2-consumer tiles."""
    p = problem()
    assert sm90_bwd.D64_ABOVE_FA2 and sm90_bwd.D64_SHAPE == (128, 128, 2) and sm90_bwd.D96_ABOVE_FA2
    fam, cfg, _ = choose(p, (9, 0))
    assert fam is FAM and (cfg.BM, cfg.BN, cfg.consumers, cfg.dq_writer) == (128, 128, 2, True)
    assert choose(p.replace(head_dim=96), (9, 0))[0].name == "sm90_bwd"
    monkeypatch.setattr(sm90_bwd, "D64_ABOVE_FA2", False)
    monkeypatch.setattr(sm90_bwd, "D96_ABOVE_FA2", False)
    for d in (32, 64, 80, 96):
        assert choose(p.replace(head_dim=d), (9, 0))[0].name == "fa2_bwd"
    assert choose(p.replace(head_dim=128), (9, 0))[0].name == "sm90_bwd"
    for shape in ((64, 64, 1), (64, 128, 2), (128, 128, 2)):
        monkeypatch.setattr(sm90_bwd, "D64_ABOVE_FA2", True)
        monkeypatch.setattr(sm90_bwd, "D64_SHAPE", shape)
        for d in (32, 64):
            fam, cfg, _ = choose(p.replace(head_dim=d), (9, 0))
            assert fam.name == "sm90_bwd" and (cfg.BM, cfg.BN, cfg.consumers) == shape
        assert choose(p.replace(head_dim=96), (9, 0))[0].name == "fa2_bwd"   # 65..96: D96_ABOVE_FA2
        for det, feats in ((False, ()), (True, ()), (False, ("dropout",)), (False, ("window",))):
            q = problem(deterministic=det, features=feats,
                        **({"dropout_p": 0.1} if "dropout" in feats else {"window": (8, 0)} if feats else {}))
            cfg = FAM.for_problem(FAM.heuristic(q), q)
            assert cfg.problems() == [] and cfg.dq_writer == (not det)


def test_kernel_source_allows_32_columns():
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "kDqN % 64 == 0 || kDqN == 32" in src
    # the second warpgroup's B operand (K_j, MN-major) starts (dq_col0 % 64) · 2 bytes into the
    # chunk's rows, only when kDqN is 32 (the plain kernels' code is unchanged)
    assert "(Shape::kDqN % 64 ? (dq_col0 % 64) * 2 : 0)" in src
    # m64n32k16 in sm90_bwd's own header: the other sm90 families' source (code hash) stays
    ptx = (kernel_dir() / "ptx_sm90_bwd.cuh").read_text()
    assert "template <> struct Wgmma<32, bf16>" in ptx and "m64n32k16.f32.f16.f16" in ptx
    assert "Wgmma<32" not in (kernel_dir() / "ptx_sm90.cuh").read_text()
    assert '#include "ptx_sm90_bwd.cuh"' in src


def compile_clean(configs):
    chunks = [configs[i::2] for i in range(2) if configs[i::2]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda c: list(zip(c, nvcc_compile(c, "sm_90a", NVCC))), chunks))
    return [f"{c.name}: {r}" for rs in done for c, r in rs
            if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r)]


SCHED = (dict(dq_writer=True), dict(overlap_sdp=True), dict(overlap_sdp=True, dq_writer=True))


@needs_nvcc
def test_ptxas_new_tiles_schedule_flags():
    """The two tiles x bf16 / fp16 x causal / not x {dq_writer, overlap_sdp, both} (BM 128:
    overlap_sdp with dq_writer only), and stages 3 with dq_writer (20 + 4 instantiations)."""
    configs = [t.replace(dtype=dt, causal=c, **f) for t, dt, c, f in
               itertools.product(NEW_TILES, ("bf16", "fp16"), (False, True), SCHED)
               if t.BM == 64 or f.get("dq_writer")]
    configs += [t.replace(stages=3, causal=c, dq_writer=True) for t in NEW_TILES for c in (False, True)]
    assert all(c.problems() == [] for c in configs) and len(set(configs)) == 24
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)


@needs_nvcc
def test_ptxas_new_tiles_feature_flags():
    """Each feature flag once per tile with dq_writer (the heuristic's dQ path), causal and not:
    window, softcap, ALiBi, all three (BM 128: a window only, bm128_spills); dropout (BM 64 only)
    alone, with window non-causal, with all three, and deterministic; deterministic with all
    three (BM 128: with a window) (17 instantiations)."""
    configs = []
    for causal in (False, True):
        for f in (dict(window=True), dict(softcap=True), dict(alibi=True),
                  dict(window=True, softcap=True, alibi=True)):
            configs.append(HALVES.replace(causal=causal, dq_writer=True, **f))
        configs.append(FA3.replace(causal=causal, dq_writer=True, window=True))
    for causal in (False, True):
        configs.append(HALVES.replace(causal=causal, dropout=True, dq_writer=True))
    configs += [HALVES.replace(dropout=True, window=True),
                HALVES.replace(dropout=True, window=True, softcap=True, alibi=True, dq_writer=True),
                HALVES.replace(causal=True, dropout=True, deterministic=True),
                HALVES.replace(causal=True, deterministic=True, window=True, softcap=True, alibi=True),
                FA3.replace(causal=True, deterministic=True, window=True)]
    assert all(c.problems() == [] for c in configs), [c.problems() for c in configs]
    assert len(set(configs)) == 17
    bad = compile_clean(configs)
    assert not bad, "\n".join(bad)
