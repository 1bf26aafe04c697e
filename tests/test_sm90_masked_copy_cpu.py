"""sm90_fwd's masked_copy (kMaskedCopy: the folded softcap step's masked blocks in a copy of their own,
so that an unmasked block's tanhs and exp2s share one basic block), without a GPU: the field, its
name / template argument / encoding, the rules, for_problem and the heuristic's switch (MASKED_COPY).
The kernels' registers and spills: test_features_opt_cpu.py::test_variants_compile_without_spills;
results against float64: tests/test_softcap_fixed_max_gpu.py and test_softcap_seeds_gpu.py (with
CUFLASH_SOFTCAP_FIELDS for values the heuristic does not pick)."""
import pytest

from cuflash import registry
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem

FAM = registry.get("sm90_fwd")
CAP = Sm90FwdConfig(128, 128, 2, 2, True, True, 128, "bf16", True, softcap=True, lazy_rescale=True, fold_cap=3,
                    dynamic=True, tma_store=True)


def problem(dtype="bf16", causal=True, features=("softcap",), cap=30.0):
    return Problem("fwd", dtype, 2, 8192, 8192, 16, 16, 128, causal, features=features,
                   softcap=cap if "softcap" in features else 0.0)


def heuristic(p):
    return FAM.for_problem(FAM.heuristic(p, (9, 0), 227 * 1024), p)


def test_field_name_template_and_encoding():
    assert CAP.masked_copy == 0 and "_mcp" not in CAP.name and "masked_copy" not in FAM.encode(CAP)
    for n in (1, 2):
        on = CAP.replace(masked_copy=n)
        assert on.problems(227 * 1024) == [] and on.name == CAP.name + f"_mcp{n}"
        assert on.kernel_name().endswith(f", {n}>") and on.template_args()[-5] == n
        assert FAM.encode(on).endswith(f",masked_copy={n}")
        assert FAM.decode(FAM.encode(on), "bf16", True) == on.replace(softcap=False)   # (features: the call's)
    # the template tail stops at the last argument set: CAP's kernel name is what it was before
    assert CAP.kernel_name().endswith("true, 3>")
    assert "masked_copy" not in FAM.space


@pytest.mark.parametrize("kw, words", [
    (dict(masked_copy=3), "must be one of"),
    (dict(masked_copy=1, fold_cap=2), "fold_cap >= 3"),
    (dict(masked_copy=1, alibi=True), "no ALiBi"),
])
def test_rules(kw, words):
    assert any(words in m for m in CAP.replace(**kw).problems(227 * 1024)), CAP.replace(**kw).problems()


def test_for_problem_drops_it_where_the_step_is_not_folded():
    on = CAP.replace(masked_copy=1)
    assert FAM.for_problem(on, problem()).masked_copy == 1
    assert FAM.for_problem(on, problem(features=("softcap", "alibi"))).masked_copy == 0
    assert FAM.for_problem(on, problem(features=(), cap=0.0)).masked_copy == 0   # (fold_cap dropped too)


def test_heuristic_switch(monkeypatch):
    # the shipped MASKED_COPY: bf16 d128 both masks the fixed-max step's copy, fp16 full both steps'
    assert heuristic(problem()).masked_copy == 1
    assert heuristic(problem(causal=False)).masked_copy == 1
    assert heuristic(problem("fp16", causal=False)).masked_copy == 2
    assert heuristic(problem("fp16", causal=True)).masked_copy == 1
    # softcap alone (where measured): not with a window
    assert heuristic(problem(features=("softcap", "window"))).masked_copy == 0
    # past the fixed max (bf16 caps above 55.45): MASKED_COPY_ROW_MAX, bf16 full copies the row-max step too
    assert heuristic(problem(causal=False).replace(softcap=80.0)).masked_copy == 2
    assert heuristic(problem(causal=False).replace(softcap=50.0)).masked_copy == 1   # (the fixed max raised)
    assert heuristic(problem().replace(softcap=80.0)).masked_copy == 1
    monkeypatch.setattr(sm90_fwd, "MASKED_COPY", {})
    assert heuristic(problem()).masked_copy == 0 and heuristic(problem("fp16", causal=False)).masked_copy == 0
