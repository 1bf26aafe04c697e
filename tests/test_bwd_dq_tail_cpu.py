"""sm90_bwd's dq_tail (kDqTail, session 31: the dQ convert as sm90_bwd_dq_tail, a programmatic dependent of the
dynamic main kernel, converting the (head, batch) pairs whose K/V tiles are done on the SMs the grid's end leaves
idle) without a GPU: the config field, its name and template argument (appended last), the rules (dq_writer on the
dynamic scheduler, fixed lengths, unordered, not with dq_convert), for_problem dropping it for other feature sets,
the plan (the convert role's kernel, one CTA an SM, pdl; the counter words), the heuristic switch
(WINDOW_DQ_TAIL), the constants the kernel repeats, and with nvcc both kernels compile clean (the convert at
most 128 registers a thread: two CTAs of 256 an SM).
"""
import os
import shutil
import sys

import pytest

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

from cuflash import registry  # noqa: E402
from cuflash.compile import kernel_dir, nvcc_compile, render_source  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")


def problem(causal=True, window=(1024, 0), seqlen=8192, **kw):
    p = Problem("bwd", "bf16", 2, seqlen, seqlen, 16, 16, 128, causal, **kw)
    return p.replace(features=("window",), window=window) if window else p


def shipped(p):
    return FAM.for_problem(FAM.heuristic(p), p)


def heur(p):
    """The heuristic's config without dq_tail (WINDOW_DQ_TAIL sets it for windows)."""
    return FAM.for_problem(FAM.heuristic(p).replace(dq_tail=0), p)


def dqt(p, form=1):
    return FAM.for_problem(heur(p).replace(dq_tail=form), p)


def test_field_name_template():
    p = problem()
    base, cfg = heur(p), dqt(p)
    assert not base.dq_tail and cfg.dq_tail and cfg.problems() == [] and cfg.name == base.name + "_dqt"
    # kDqTail last: kDropPacked and kCapFold written out before it; other kernels keep their name expressions
    assert cfg.kernel_name() == base.kernel_name()[:-1] + ", 0, 0, 1>"
    assert cfg.template_args()[:-1] == base.template_args()[:-1] and cfg.template_args()[-1] == 1
    assert len(cfg.template_args()) == 31
    two = dqt(p, 2)
    assert two.name == base.name + "_dqt2" and two.kernel_name() == base.kernel_name()[:-1] + ", 0, 0, 2>"
    assert FAM.decode(FAM.encode(two), "bf16", True).dq_tail == 2 and not two.problems()
    assert "dq_tail" in " ".join(cfg.replace(dq_tail=3).problems())
    assert FAM.decode(FAM.encode(cfg), "bf16", True).dq_tail and "dq_tail" not in FAM.encode(base)
    assert "dq_tail" not in FAM.space and not FAM.make(FAM.point(cfg), p).dq_tail   # (outside the space: off)
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "int kDropPacked = 0, int kCapFold = 0, int kDqTail = 0>" in src
    assert (f"static constexpr int kThreads = {sm90_bwd.DQ_TAIL_THREADS}, kCtasPerSm = {sm90_bwd.DQ_TAIL_CTAS_PER_SM};"
            in src)


def test_rules_and_for_problem():
    cfg = dqt(problem())
    why = lambda c: " ".join(c.problems())   # noqa: E731
    for change in (dict(dynamic=False), dict(dq_writer=False, dynamic=False), dict(dq_convert=True),
                   dict(deterministic=True), dict(varlen=True)):
        assert "dq_tail" in why(cfg.replace(**change)), change
    # kept for plain and windowed calls, dropped for other feature sets
    for p in (problem(), problem(False, (1024, 1024)), problem(window=None), problem(False, None)):
        assert dqt(p).dq_tail, p
    for p in (problem(window=None).replace(features=("softcap",), softcap=5.0),
              problem(window=None).replace(features=("alibi",))):
        got = FAM.for_problem(heur(p).replace(dq_tail=2), p)
        assert not got.dq_tail and got.problems() == [], got.name


def test_plan():
    p = problem()
    cfg, base = dqt(p), heur(p)
    specs = FAM.launches(cfg, p, 132)
    assert [s.role for s in specs] == ["preprocess", "main", "convert_dq"]
    tail = specs[-1]
    assert tail.grid == (2 * 132, 1, 1) and tail.threads == sm90_bwd.DQ_TAIL_THREADS and tail.pdl and not tail.smem
    assert not any(s.pdl for s in FAM.launches(base, p, 132))
    assert FAM.kernel_names(cfg)["convert_dq"] == "cuflash::sm90_bwd_dq_tail<cuflash::bf16, 128>"
    assert FAM.kernel_names(base)["convert_dq"] == "cuflash::fa2_bwd_convert_dq<cuflash::bf16>"
    from cuflash.compile import kernel_param_decl

    assert kernel_param_decl(FAM, "convert_dq", FAM.kernel_names(cfg)["convert_dq"]) == \
        "const __grid_constant__ cuflash::Sm90BwdParams"
    assert kernel_param_decl(FAM, "convert_dq", FAM.kernel_names(base)["convert_dq"]) == "const cuflash::BwdParams"
    # the claim counter, the convert's ticket and finished CTAs, then one tile count per pair
    assert FAM.zeroed_counters(cfg, p) == {"tile_counter": 3 + 32}
    gqa = Problem("bwd", "bf16", 2, 1023, 1100, 4, 2, 128, True).replace(features=("window",), window=(100, 0))
    assert [s.role for s in FAM.launches(dqt(gqa), gqa, 132)] == ["preprocess", "main", "convert_dq", "reduce_dkv"]


def test_heuristic_switch(monkeypatch):
    assert sm90_bwd.WINDOW_DQ_TAIL == {(128, "bf16", False): 2, (128, "bf16", True): 2}   # (session 31)
    assert shipped(problem()).dq_tail == 2 and shipped(problem(False, (1024, 1024))).dq_tail == 2
    assert shipped(problem().replace(dtype="fp16")).dq_tail == 0   # (not measured)
    assert not shipped(problem(window=None)).dq_tail and not shipped(problem(False, None)).dq_tail
    for form in (1, 2):
        monkeypatch.setattr(sm90_bwd, "WINDOW_DQ_TAIL", {(128, "bf16", c): form for c in (False, True)})
        for p in (problem(), problem(False, (1024, 1024)), problem(seqlen=1000, window=(64, 64))):
            cfg = shipped(p)
            assert cfg.dq_tail == form and cfg.problems() == [], cfg.name
        assert not shipped(problem(window=None)).dq_tail
        assert not shipped(problem().replace(deterministic=True)).dq_tail
    monkeypatch.setattr(sm90_bwd, "WINDOW_DQ_TAIL", {})
    assert not shipped(problem()).dq_tail


@needs_nvcc
def test_ptxas_clean(tmp_path):
    """The dq_tail main kernel (the window heuristic's) and the convert: no spill, no stack, and the
    convert at most 128 registers (256 threads: two CTAs an SM, none beside a main CTA)."""
    import re
    import subprocess

    for r in nvcc_compile([dqt(problem()), dqt(problem(), 2)], "sm_90a", NVCC):
        assert not (r.spill_stores or r.spill_loads or r.stack_bytes), r
    src = tmp_path / "tail.cu"
    src.write_text(render_source("sm90_bwd") + "template __global__ void cuflash::sm90_bwd_dq_tail<cuflash::bf16, 128>"
                   "(const __grid_constant__ cuflash::Sm90BwdParams);\n")
    out = subprocess.run([NVCC, "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "tail.cubin"), "-Xptxas", "-v",
                          str(src)], capture_output=True, text=True, check=True).stderr
    block = out[out.index("sm90_bwd_dq_tail"):]
    regs = int(re.search(r"Used (\d+) registers", block).group(1))
    assert "0 bytes spill stores, 0 bytes spill loads" in block and regs <= 128, block[:400]


def test_window_default_takes_dq_tail_at_padded_head_dims():
    """What test_bwd_dq_tail_gpu.test_window_padded_head_dims relies on: the bf16 window backward's heuristic
    takes dq_tail 2 on the d128 kernel for real head dims 80 / 96 / 112 (GQA, MQA, both masks)."""
    from cuflash import registry
    from cuflash.problem import Problem

    fam = registry.get("sm90_bwd")
    for d in (80, 96, 112):
        for causal, window in ((True, (300, 0)), (False, (200, 64))):
            for sq, hkv in ((1023, 4), (113, 1)):
                p = Problem("bwd", "bf16", 2, sq, 1023, 16, hkv, d, causal).replace(
                    features=("window",), window=window)
                cfg = fam.for_problem(fam.heuristic(p, (9, 0)), p)
                assert cfg.dq_tail == 2 and cfg.name.startswith("sm90bwd_bf16_d128"), cfg.name
