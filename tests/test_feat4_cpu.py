"""CPU checks of sm90_fwd's issue-12 overhead variants (session 16, helper feat4): drop_packed
(kDropPacked, kernels_cu/dropout_packed.cuh) and emu_exp2 with fold_cap (softmax_fold.cuh): their
rules, names and kernel names (every config without them keeps its name and template arguments),
how for_problem and the heuristic set them, the timing script's candidates, and the nvcc build (zero
spills, sm_90a). The GPU checks: tests/test_feat4_gpu.py."""
import os
import shutil
import sys

import pytest

from cuflash import registry
from cuflash.families import sm90_fwd
from cuflash.problem import Problem

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
MAX_SMEM = 227 * 1024


def problem(features=(), causal=True, d=128, dtype="bf16", **kw):
    return Problem("fwd", dtype, 2, 8192, 8192, 16, 16, d, causal, features=features, **kw)


def heuristic(p):
    return FAM.for_problem(FAM.heuristic(p), p)


def test_drop_packed_rules_and_names():
    p = problem(("dropout",), dropout_p=0.1)
    cfg = heuristic(p).replace(drop_early=0)   # (drop_early: tests/test_drop_early_cpu.py)
    assert cfg.dropout and cfg.drop_packed == (128 in sm90_fwd.DROPOUT_PACKED)
    packed = cfg.replace(drop_packed=True)
    assert packed.name == cfg.replace(drop_packed=False).name + "_dpk"
    assert packed.kernel_name().endswith(", true>") and packed.problems(MAX_SMEM) == []
    # the template tail stops at the last argument set: without it the kernel name is unchanged
    assert "true, 0, true>" in cfg.replace(drop_packed=False).kernel_name()
    # (kDropEarly, kStreamTail, kPvOverlap, kMaskedCopy, kRagKeys, kPrefetch, kSAhead and kDeferMax after it)
    assert packed.template_args()[-9] is True and cfg.replace(drop_packed=False).template_args()[-9] is False
    # BN: DROPOUT_PACKED_BN at d128 (192), DROPOUT_BN without drop_packed (160)
    assert packed.replace(BN=192).problems(MAX_SMEM) == []
    assert any("DROPOUT_BN" in m for m in cfg.replace(drop_packed=False, BN=192).problems(MAX_SMEM))
    # needs dropout, not p_smem
    plain = heuristic(problem())
    assert any("drop_packed" in m for m in plain.replace(drop_packed=True).problems(MAX_SMEM))
    # for_problem: kept with dropout (the config's own), dropped without it
    assert FAM.for_problem(packed, p).drop_packed
    assert not FAM.for_problem(packed, problem()).drop_packed


def test_drop_packed_module_switch(monkeypatch):
    p = problem(("dropout",), dropout_p=0.1)
    monkeypatch.setattr(sm90_fwd, "DROPOUT_PACKED", frozenset({128}))
    assert heuristic(p).drop_packed
    assert not heuristic(problem()).drop_packed
    assert not heuristic(problem(("dropout",), d=64, dropout_p=0.1)).drop_packed
    monkeypatch.setattr(sm90_fwd, "DROPOUT_PACKED", frozenset())
    assert not heuristic(p).drop_packed


def test_emu_exp2_with_fold_cap():
    p = problem(("softcap",), softcap=30.0)
    cfg = heuristic(p)
    assert cfg.fold_cap == 3 and cfg.lazy_rescale and cfg.emu_exp2 == 0   # SOFTCAP_FOLD_EMU_EXP2 empty
    for k in (1, 2, 3, 4):
        emu = FAM.for_problem(cfg.replace(emu_exp2=k), p)
        assert emu.emu_exp2 == k and emu.fold_cap == 3 and emu.lazy_rescale, emu.name
        assert emu.problems(MAX_SMEM) == [], emu.problems(MAX_SMEM)
        assert f"_emu{k}_" in emu.name
    # lazy_rescale with emu_exp2 but without fold_cap: refused (and dropped by for_problem)
    bad = cfg.replace(fold_cap=0, emu_exp2=1)
    assert any("emu_exp2 only with fold_cap" in m for m in bad.problems(MAX_SMEM))
    assert not FAM.for_problem(bad, p).lazy_rescale


def test_fold_emu_module_switch(monkeypatch):
    p = problem(("softcap",), softcap=30.0)
    monkeypatch.setattr(sm90_fwd, "SOFTCAP_FOLD_EMU_EXP2", {(128, True): 2})
    # (not with the masked blocks' copy of the step, MASKED_COPY's note: the shipped heuristic's)
    assert heuristic(p).emu_exp2 == 0 and heuristic(p).masked_copy == 1
    monkeypatch.setattr(sm90_fwd, "MASKED_COPY", {})
    assert heuristic(p).emu_exp2 == 2 and heuristic(p).fold_cap == 3
    assert heuristic(problem(("softcap",), causal=False, softcap=30.0)).emu_exp2 == 0


def test_the_timing_scripts_candidates_are_valid():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here]
    try:
        import features_overhead_timing as timing
    finally:
        sys.path.remove(here)
    seen = {}
    for feature in timing.FEATURES:
        for causal in (True, False):
            for key, _, cfg in timing.fwd_candidates(feature, causal):
                assert cfg.problems(MAX_SMEM) == [], (feature, key, cfg.problems(MAX_SMEM))
                seen[(feature, causal, key)] = cfg
    assert seen[("dropout", True, "heuristic")].drop_packed      # DROPOUT_PACKED (d128)
    assert seen[("softcap", False, "emu2")].emu_exp2 == 2
    assert ("alibi", True, "alin_bn160_tmao") not in seen        # spills causal (nvcc 13.0)


def new_instantiations():
    """The kernels the feat4 GPU round runs that nothing else builds: drop_packed at d128 (BN 160, 192,
    160 with the TMA store) and the folded softcap with emu_exp2 1 / 2."""
    out = []
    for causal in (True, False):
        drop = heuristic(problem(("dropout",), causal, dropout_p=0.1)).replace(drop_packed=True, drop_early=0)
        out += [drop, drop.replace(BN=192), drop.replace(BN=160, tma_store=True)]
        cap = heuristic(problem(("softcap",), causal, softcap=30.0))
        # (emu_exp2 2 at fold_cap 3's full tile, BN 144, spills 4 bytes: nvcc 13.0; off, measured slower)
        out += [cap.replace(emu_exp2=1)] + [cap.replace(emu_exp2=2)] * causal
    return out


@needs_nvcc
def test_new_instantiations_compile_without_spills():
    from cuflash.compile import nvcc_compile

    cfgs = new_instantiations()
    for cfg, rep in zip(cfgs, nvcc_compile(cfgs, "sm_90a")):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, (cfg.name, rep)
        assert not any("serializ" in w for w in rep.warnings), (cfg.name, rep.warnings)


def test_window_tiles_take_q_double_and_tree_max(monkeypatch):
    """FEATURE_TILES' window entry may carry q_double / tree_max; they apply to a window alone."""
    tiles = {128: dict(sm90_fwd.FEATURE_TILES[128], window=dict(sm90_fwd.FEATURE_TILES[128]["window"],
                                                                 q_double=True, tree_max=True))}
    monkeypatch.setattr(sm90_fwd, "FEATURE_TILES", tiles)
    win = heuristic(problem(("window",), window=(1024, 0)))
    assert win.q_double and win.tree_max and win.problems(MAX_SMEM) == [], win.problems(MAX_SMEM)
    both = heuristic(problem(("alibi", "window"), window=(1024, 0)))
    assert not both.q_double and not both.tree_max and both.problems(MAX_SMEM) == []
