"""sm90_bwd's folded softcap step (cap_fold, kCapFold; session 23, cap10) without a GPU: the config's
rules and encoding, and the kernels compiled for sm_90a (nvcc, ptxas -v): no spill, no serialized wgmma,
and fewer instructions than the unfolded step (SASS, where cuobjdump is found). Correctness on the GPU:
tests/test_sm90_bwd_cap_fold_gpu.py."""
import re

import pytest

from cuflash import registry
from cuflash.families import sm90_bwd
from cuflash.problem import Problem

from test_sm90_softcap_cpu import _cuobjdump  # noqa: E402
from test_sm90_tile_overlap_cpu import needs_nvcc  # noqa: E402

FAM = registry.get("sm90_bwd")


def softcap_config(dtype="bf16", causal=True, d=128, **fields):
    p = Problem("bwd", dtype, 2, 8192, 8192, 16, 16, d, causal, features=("softcap",), softcap=30.0)
    return FAM.for_problem(FAM.heuristic(p, (9, 0), 227 * 1024), p).replace(**fields), p


def test_cap_fold_rules_and_names():
    base, p = softcap_config()
    assert base.cap_fold == sm90_bwd.SOFTCAP_CAP_FOLD.get((128, True, "bf16"), 0)
    plain = base.replace(cap_fold=0)
    assert "cap_fold" not in FAM.encode(plain)
    for form in (1, 2, 3):
        cfg = FAM.for_problem(plain.replace(cap_fold=form), p)
        assert cfg.cap_fold == form and not cfg.problems(227 * 1024)
        assert cfg.name == plain.name + f"_cf{form}"
        assert cfg.kernel_name().endswith(f", 0, {form}>") and cfg.template_args()[-2] == form
        assert cfg.template_args()[:-2] == plain.template_args()[:-2]
        assert FAM.decode(FAM.encode(cfg), "bf16", True).cap_fold == form   # (the feature flags: the call sets them)
        assert any("spills" in w for w in cfg.replace(wide_epi=False).problems(227 * 1024))
        for other in (dict(alibi=True), dict(dropout=True), dict(softcap=False)):
            assert any("cap_fold" in w for w in cfg.replace(**other).problems(227 * 1024)), other
        # a call without softcap alone drops it (a plain call through the same bwd_config)
        assert FAM.for_problem(cfg, p.replace(features=(), softcap=0.0)).cap_fold == 0
    assert any("cap_fold must be" in w for w in plain.replace(cap_fold=4).problems(227 * 1024))
    fp16, _ = softcap_config("fp16")
    assert not fp16.replace(cap_fold=1).problems(227 * 1024)
    assert all(any("bf16 only" in w for w in fp16.replace(cap_fold=f).problems(227 * 1024)) for f in (2, 3))


def test_cap_fold_heuristic():
    """SOFTCAP_CAP_FOLD's classes (bf16 d128, causal and not) take form 3 with wide_epi, MHA or GQA, where the
    heuristic's kernel is the dynamic one (8k: measured); fp16, deterministic, other head dims, softcap with
    another feature and shorter calls (the plain-grid kernels, not measured) keep the unfolded step."""
    on = sm90_bwd.SOFTCAP_CAP_FOLD
    assert on == {(128, True, "bf16"): 3, (128, False, "bf16"): 3}
    for causal in (True, False):
        for heads in ((16, 16), (16, 4)):
            p = Problem("bwd", "bf16", 2, 8192, 8192, *heads, 128, causal, features=("softcap",), softcap=50.0)
            cfg = FAM.for_problem(FAM.heuristic(p, (9, 0), 227 * 1024), p)
            assert cfg.cap_fold == 3 and cfg.wide_epi and cfg.dynamic and not cfg.problems(227 * 1024), cfg.name
            assert cfg.name.endswith("_w16_cf3")
            short = p.replace(seqlen_q=1024, seqlen_k=1024)
            cfg = FAM.for_problem(FAM.heuristic(short, (9, 0), 227 * 1024), short)
            assert cfg.cap_fold == (3 if cfg.dynamic else 0), cfg.name
        for other in (dict(dtype="fp16"), dict(deterministic=True), dict(head_dim=64),
                      dict(features=("softcap", "alibi")), dict(features=("softcap", "window"), window=(256, 0))):
            q = p.replace(**other)
            assert FAM.for_problem(FAM.heuristic(q, (9, 0), 227 * 1024), q).cap_fold == 0, other
    plain = Problem("bwd", "bf16", 2, 4096, 4096, 16, 16, 128, True)
    assert FAM.for_problem(FAM.heuristic(plain, (9, 0), 227 * 1024), plain).cap_fold == 0


@needs_nvcc
@pytest.mark.parametrize("dtype,causal", [("bf16", True), ("bf16", False)])
def test_cap_fold_kernels_compile_clean(dtype, causal):
    """Forms 0 (the unfolded step, at the same template arguments), 1, 2 and 3: no spill, no serialized
    wgmma; in SASS forms 1-3 hold the step twice (the masked blocks' copy: 2 x 32 MUFU.TANH a Q block,
    form 0 32), forms 2 and 3 multiply dSᵀ by HMUL2 (16), form 2 is shorter than form 1, and form 3
    takes 8 of each copy's 32 exp2s off the SFU."""
    from test_sm90_pv_overlap_cpu import compile_clean

    base, _ = softcap_config(dtype, causal, wide_epi=True)   # (without it the dynamic d128 kernel spills)
    sass = compile_clean([base.replace(cap_fold=f) for f in (0, 1, 2, 3)], sass=_cuobjdump() is not None, fam=FAM)
    counts = {}
    for args, fn in sass.items():
        ins = [i for i in re.findall(r"/\*[0-9a-f]{4,5}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", fn) if i != "NOP"]
        # (by kCapFold; kDqTail is last)
        counts[args[-2]] = (len(ins), ins.count("MUFU.TANH"), ins.count("MUFU.EX2"),
                            sum(i.startswith("HMUL2") for i in ins))
    if counts:
        assert [(counts[f][1], counts[f][3]) for f in (0, 1, 2, 3)] == [(32, 0), (64, 0), (64, 16), (64, 16)], counts
        assert counts[2][0] < counts[1][0] and counts[3][2] == counts[2][2] - 16, counts
