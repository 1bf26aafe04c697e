"""sm90_fwd's defer_max (kDeferMax: the folded softcap row-max step's exp2s from the running max as it was,
the block's max taken after them, softmax_fold.cuh softmax_step_deferred) without a GPU: the field's rules,
name, template argument and encoding, for_problem, and its kernels compiling without spills or serialized
wgmma (nvcc -cubin sm_90a)."""
import os
import sys

import pytest

from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sm90_pv_overlap_cpu import compile_clean  # noqa: E402
from test_sm90_tile_overlap_cpu import FAM, needs_nvcc  # noqa: E402

GEMMA = Problem("fwd", "bf16", 2, 8192, 8192, 16, 16, 128, True, features=("softcap",), softcap=50.0)


def heuristic(problem=GEMMA):
    return FAM.for_problem(FAM.heuristic(problem, (9, 0), 227 * 1024), problem)


def test_field_name_template_and_encoding():
    base = heuristic()
    on = base.replace(defer_max=True)
    assert base.fold_cap >= 3 and base.lazy_rescale and not base.defer_max
    assert on.validate(227 * 1024) is on and on.name == base.name + "_dmx"
    assert on.kernel_name().endswith(", false, true>")          # (kSAhead false, kDeferMax)
    assert on.template_args()[-1] is True and base.template_args()[-1] is False
    assert "defer_max" not in FAM.encode(base) and FAM.encode(on).endswith(",defer_max=1")
    assert FAM.decode(FAM.encode(on), "bf16", True).replace(softcap=True) == on
    assert "defer_max" not in FAM.space


@pytest.mark.parametrize("change", [dict(fold_cap=0), dict(lazy_rescale=False, fold_cap=1), dict(alibi=True),
                                    dict(softcap=False, fold_cap=0)])
def test_rules(change):
    why = heuristic().replace(defer_max=True, **change).problems(227 * 1024)
    assert any("defer_max" in w for w in why), (change, why)


def test_for_problem():
    on = heuristic().replace(defer_max=True)
    assert FAM.for_problem(on, GEMMA) == on
    assert FAM.for_problem(on, GEMMA.replace(features=("softcap", "alibi"))).defer_max is False


@needs_nvcc
def test_kernels_compile_clean():
    compile_clean([heuristic().replace(defer_max=True), heuristic().replace(defer_max=True, masked_copy=2),
                   heuristic(GEMMA.replace(causal=False)).replace(defer_max=True),
                   heuristic(GEMMA.replace(dtype="fp16", softcap=30.0)).replace(defer_max=True)], sass=False)
