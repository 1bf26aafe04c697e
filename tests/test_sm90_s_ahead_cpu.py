"""sm90_fwd's s_ahead (kSAhead: S_{j+1} issued before the folded softcap step of S_j, into a second
accumulator, kernels_cu/sm90_fwd.cu sm90_consume_blocks_ahead) without a GPU: the field's rules,
name, template argument and encoding, for_problem dropping it without softcap, and the point of it in
the SASS (nvcc -cubin sm_90a, cuobjdump): in the loop, the S_{j+1} wgmmas are issued right before the
step's tanhs and exp2s, which all run before the next wait (WARPGROUP.DEPBAR.LE gsb0, 0x0); no spills, no
serialized wgmma."""
import os
import sys

import pytest

from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sm90_pv_overlap_cpu import compile_clean  # noqa: E402
from test_sm90_tile_overlap_cpu import FAM, needs_nvcc  # noqa: E402

CAP = Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, 128, True, features=("softcap",), softcap=30.0)


def heuristic(problem=CAP):
    return FAM.for_problem(FAM.heuristic(problem, (9, 0), 227 * 1024), problem)


def sah(problem=CAP, **change):
    return heuristic(problem).replace(**{"s_ahead": True, "BN": 96, "stages": 3, **change})


def test_field_name_template_and_encoding():
    base = heuristic()
    on = sah()
    assert not base.s_ahead and on.validate(227 * 1024) is on
    assert on.name.endswith("_mcp1_sah") and "_sah" not in base.name
    assert on.kernel_name().endswith(", 1, 0, false, true>") and base.kernel_name().endswith(", 1>")   # (kMaskedCopy, kRagKeys, kPrefetch, kSAhead)
    assert on.template_args()[-2] is True and base.template_args()[-2] is False   # (kDeferMax last)
    assert "s_ahead" not in FAM.encode(base) and FAM.encode(on).endswith(",s_ahead=1")
    assert FAM.decode(FAM.encode(on), "bf16", True).replace(softcap=True) == on   # (features: the call's)
    assert "s_ahead" not in FAM.space


@pytest.mark.parametrize("change", [dict(fold_cap=0), dict(alibi=True), dict(window=True),
                                    dict(pv_overlap=True), dict(tile_overlap=True), dict(p_smem=True)])
def test_rules(change):
    why = sah().replace(**change).problems(227 * 1024)
    assert any("s_ahead" in w for w in why), (change, why)


def test_for_problem():
    on = sah()
    assert FAM.for_problem(on, CAP) == on
    plain = CAP.replace(features=(), softcap=None)
    assert FAM.for_problem(on, plain).s_ahead is False
    both = CAP.replace(features=("softcap", "alibi"))
    assert FAM.for_problem(on, both).s_ahead is False


def loop_steps(sass: str) -> list:
    """Per WARPGROUP.ARRIVE of a kernel's SASS: the HGMMAs after it and the MUFU.TANH / EX2 issued before
    the next ARRIVE or WARPGROUP.DEPBAR."""
    out = []
    for line in sass.splitlines():
        if "WARPGROUP.ARRIVE" in line or "WARPGROUP.DEPBAR" in line:
            out.append(dict(kind="arrive" if "ARRIVE" in line else "wait", hgmma=0, tanh=0, ex2=0))
        elif out:
            out[-1]["hgmma"] += "HGMMA" in line
            out[-1]["tanh"] += "MUFU.TANH" in line
            out[-1]["ex2"] += "MUFU.EX2" in line
    return out


@needs_nvcc
def test_sass_step_under_both_gemms():
    full = CAP.replace(causal=False)
    # (BN 112, stages 3 without the TMA store, spills 8 bytes: ptxas, nvcc 13.0; round 1 timed it, 1.338 x plain)
    cfgs = [sah(), sah(full), sah(CAP.replace(dtype="fp16")), sah(BN=64, stages=4)]
    by = compile_clean(cfgs)
    for c in cfgs:
        steps = loop_steps(by[tuple(c.template_args())])
        # the loop's turn: O += P V (BN / 16 k16 steps, each with its row-sum wgmma), then S_{j+1} (head
        # dim / 16 steps) in its own arrive, and after it every tanh and exp2 of the step (both copies of
        # masked_copy) before the next wait
        s_next = [i for i, s in enumerate(steps) if s["kind"] == "arrive" and s["hgmma"] == c.head_dim // 16
                  and s["tanh"] and i > 0 and steps[i - 1]["kind"] == "arrive" and steps[i - 1]["hgmma"] == c.BN // 8]
        assert len(s_next) == 1, (c.name, steps)
        i = s_next[0]
        assert steps[i]["tanh"] >= c.BN and steps[i]["ex2"] >= c.BN and steps[i + 1]["kind"] == "wait", c.name
