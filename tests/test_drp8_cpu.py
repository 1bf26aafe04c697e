"""Issue 12's dropout overhead without a GPU (session 27, drp8): sm90_bwd's plain speed fields on the
drop_packed 2 tile (drop_packed_fast, DROPOUT_FAST_SETS, DROPOUT_FAST), wide_epi with dropout, the timing
forms (sm90_fwd drop_early 5 / 6, sm90_bwd drop_packed 3: not the mask), sm90_fwd's TMA-store epilogue with
the dropout kernel, and the instantiations' ptxas reports (no spills, no serialized wgmma)."""
import itertools
import os
import shutil

import pytest

from cuflash import registry
from cuflash.families import sm90_bwd, sm90_fwd
from cuflash.problem import Problem
from cuflash.select import choose

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FWD, BWD = registry.get("sm90_fwd"), registry.get("sm90_bwd")
MAX = 227 * 1024
FIELDS = sm90_bwd.DROPOUT_FAST_FIELDS


def drop_problem(op="bwd", causal=True, d=128, dtype="bf16", **kw):
    return Problem(op, dtype, 2, 8192, 8192, 16, 16, d, causal, features=("dropout",), dropout_p=0.1, **kw)


def selected(p):
    return choose(p, (9, 0), "", MAX)[1]


def fast_configs(dtype="bf16", causal=True):
    """The selection's dropout backward with each of DROPOUT_FAST_SETS' fields (drop_packed 2)."""
    base = selected(drop_problem(causal=causal, dtype=dtype)).replace(drop_packed=2)
    return [base.replace(**{k: k in s for k in FIELDS}) for s in sorted(sm90_bwd.DROPOUT_FAST_SETS, key=sorted)]


@pytest.mark.parametrize("dtype, causal", list(itertools.product(("bf16", "fp16"), (False, True))))
def test_drop_packed_fast_sets_are_valid_and_only_they(dtype, causal):
    sel = selected(drop_problem(causal=causal, dtype=dtype))
    fast = sm90_bwd.DROPOUT_FAST.get((128, dtype, causal))
    assert sel.drop_packed == 2   # selection: DROPOUT_FAST's entry's fields
    assert all(getattr(sel, k) == bool((fast or {}).get(k)) for k in FIELDS), sel.name
    base = sel.replace(drop_packed=2, **{k: False for k in FIELDS})
    for cfg in fast_configs(dtype, causal):
        assert cfg.drop_packed_fast() and not cfg.problems(MAX), cfg.name
    assert any("drop_packed must be" in w for w in sel.replace(drop_packed=4).problems(MAX))
    every = base.replace(**{k: True for k in FIELDS})
    assert every.name.endswith("_dqw_dyn_ds2_dqe_dkl_pin_w16_dpk2")
    # sets not checked, form 1, d64, the per-element kernel (drop_packed 0) with wide_epi: refused
    assert any("drop_packed" in w for w in base.replace(dynamic=True, wide_epi=True).problems(MAX))
    assert any("drop_packed" in w for w in every.replace(drop_packed=1).problems(MAX))
    assert any("wide_epi" in w for w in base.replace(drop_packed=0, wide_epi=True).problems(MAX))
    d64 = selected(drop_problem(causal=causal, dtype=dtype, d=64))
    assert d64.replace(dynamic=True).problems(MAX)


def test_for_problem_keeps_a_given_fast_config_and_the_switch(monkeypatch):
    p = drop_problem(causal=True)
    every = selected(p).replace(drop_packed=2, **{k: True for k in FIELDS})
    assert BWD.for_problem(every, p) == every                     # bwd_config= with drop_packed 2: kept
    none = every.replace(**{k: False for k in FIELDS})
    assert BWD.for_problem(none, p) == none                       # likewise without the fields
    plain = selected(p.replace(features=(), dropout_p=0.0))
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {})
    assert BWD.for_problem(plain, p).name.endswith("_drop_dqw_dpk2")  # the plain heuristic's: stripped
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {(128, "bf16", True): {k: True for k in FIELDS}})
    assert BWD.for_problem(plain, p).name.endswith("_drop_dqw_dyn_ds2_dqe_dkl_pin_w16_dpk2")
    monkeypatch.setattr(sm90_bwd, "DROPOUT_PACKED", {})   # (the fields ride on DROPOUT_PACKED's form 2)
    assert not BWD.for_problem(plain, p).drop_packed and not BWD.for_problem(plain, p).dynamic
    assert not BWD.for_problem(plain, drop_problem(causal=False)).dynamic   # (only the entry's mask)
    # not for dropout mixes, varlen or deterministic calls
    mix = p.replace(features=("dropout", "window"), window=(256, 0))
    assert not BWD.for_problem(plain, mix).dynamic


def test_timing_forms_are_refused_unless_asked(monkeypatch):
    fwd = FWD.for_problem(FWD.heuristic(drop_problem("fwd")), drop_problem("fwd"))
    bwd = selected(drop_problem()).replace(drop_packed=2)
    for form in (5, 6):
        assert any("timing form" in w for w in fwd.replace(drop_early=form).problems(MAX))
    assert any("timing form" in w for w in bwd.replace(drop_packed=3).problems(MAX))
    monkeypatch.setattr(sm90_fwd, "DROP_EARLY_TIMING", True)
    monkeypatch.setattr(sm90_bwd, "DROP_PACKED_TIMING", True)
    for form in (5, 6):
        c = fwd.replace(drop_early=form)
        assert not c.problems(MAX) and c.name.endswith(f"_dpe{form}") and c.template_args()[26] == form and c.kernel_name().endswith(f", {form}>")
    c = bwd.replace(drop_packed=3)
    assert not c.problems(MAX) and c.name.endswith("_dpk3") and c.template_args()[-3] == 3
    assert not bwd.replace(drop_packed=3, **{k: True for k in FIELDS}).problems(MAX)


def test_fwd_tma_store_with_the_dropout_kernel():
    """The TMA-store epilogue with drop_packed / drop_early 1: valid (problems()), full and causal."""
    for causal in (False, True):
        p = drop_problem("fwd", causal=causal)
        cfg = FWD.for_problem(FWD.heuristic(p), p)
        assert cfg.drop_packed and cfg.drop_early == 1
        assert not cfg.replace(tma_store=True).problems(MAX)


@needs_nvcc
def test_fast_sets_and_tmao_compile_without_spills():
    """Every DROPOUT_FAST_SETS kernel (bf16 / fp16, causal or not) and the dropout forward with the TMA-store
    epilogue: no spills, no serialized wgmma (ptxas, nvcc 13.0, sm_90a)."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    cfgs = [c for dtype, causal in itertools.product(("bf16", "fp16"), (False, True))
            for c in fast_configs(dtype, causal) if any(getattr(c, k) for k in FIELDS)]
    for dtype, causal in itertools.product(("bf16", "fp16"), (False, True)):
        p = drop_problem("fwd", causal=causal, dtype=dtype)
        cfgs.append(FWD.for_problem(FWD.heuristic(p), p).replace(tma_store=True))
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda c: nvcc_compile([c], "sm_90a", NVCC)[0], cfgs))
    bad = [f"{c.name}: {r}" for c, r in zip(cfgs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or any("C751" in w or "serialized" in w for w in r.warnings)]
    assert not bad, "\n".join(bad)
