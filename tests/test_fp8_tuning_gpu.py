"""The tuner's FP8 runner on an H100 (tuning/measure.py Fp8FwdRunner): one sm90_fwd_fp8 config
compiled, verified with cuflash.fp8's error rule and timed through GpuMeasure; a config that
computes garbage is caught as "wrong". One compile (the d128 non-causal heuristic, shared with
test_fp8_gpu.py)."""
import pytest

from cuflash import _gpu, registry
from cuflash.problem import Problem

pytestmark = pytest.mark.gpu


def require_sm90():
    if not _gpu.available() or _gpu.arch() != (9, 0):
        pytest.skip("sm90_fwd_fp8 needs an sm_90 GPU")


def test_fp8_measure_verifies_and_times():
    require_sm90()
    from cuflash.tuning.measure import GpuMeasure

    fam = registry.get("sm90_fwd_fp8")
    p = Problem.fa_convention("fwd", "e4m3", 128, False, 2048)
    cfg = fam.heuristic(p)
    res = GpuMeasure(fam, p, reps=5, warmup=1, seed=0)(cfg)
    assert res.status == "ok", res.reason
    assert res.extra["max_err"] <= 2 * res.extra["lowp_err"] + 1e-2, res.extra
    assert 0 < res.median_ms < 100 and res.extra["reps"] == 5


def test_fp8_measure_catches_a_wrong_answer(monkeypatch):
    require_sm90()
    from cuflash import fp8
    from cuflash.tuning import measure

    fam = registry.get("sm90_fwd_fp8")
    p = Problem.fa_convention("fwd", "e4m3", 128, False, 512)
    real = fp8.reference_fp8
    monkeypatch.setattr(fp8, "reference_fp8", lambda *a, **k: tuple(x * 1.5 for x in real(*a, **k)))
    monkeypatch.setattr(measure.GpuMeasure, "_checked", {})
    res = measure.GpuMeasure(fam, p, reps=2, warmup=1, seed=1)(fam.heuristic(p))
    assert res.status == "wrong", res
