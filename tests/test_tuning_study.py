"""The optuna side of the tuner against a deterministic fake measurement (tuning/fake.py):
pruning and memoisation, full TPE and brute-force studies, resuming a killed run from
the journal file, the trial records. CPU only; needs optuna."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from cuflash import registry, select  # noqa: E402
from cuflash.families.base import MAX_SMEM_BY_ARCH  # noqa: E402
from cuflash.tuning.fake import FakeMeasure, model_ms  # noqa: E402
from cuflash.tuning.objective import Objective, TrialResult  # noqa: E402
from cuflash.tuning.space import bench_problem, point_key  # noqa: E402
from cuflash.tuning.study import (open_storage, run_study, study_name_for, write_plots,  # noqa: E402
                                  write_trials)

REPO = Path(__file__).resolve().parent.parent
SMEM = MAX_SMEM_BY_ARCH[(9, 0)]
FAM = registry.get("fa2_fwd")
PROBLEM = bench_problem(FAM, "bf16", 128, True, 4096)
VALID = FAM.valid(PROBLEM, SMEM)
DEFAULT = FAM.heuristic(PROBLEM, (9, 0), SMEM)
BEST = min(VALID, key=model_ms)
KEYS = tuple(FAM.space)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study(**kw):
    args = dict(max_smem=SMEM, arch=(9, 0), seed=0, log=lambda *a: None)
    args.update(kw)
    measure = args.pop("measure", None) or FakeMeasure()
    return run_study(FAM, PROBLEM, measure, **args), measure


# ---------------------------------------------------------------------------------------
# the objective

def test_invalid_points_are_pruned_with_the_reason_and_never_measured():
    measure = FakeMeasure()
    obj = Objective(FAM, PROBLEM, measure, SMEM)
    s = optuna.create_study()
    bad = {"Br": 64, "Bc": 32, "warps": 8, "stages": 2}     # 64 rows over 8 warps of 16
    s.enqueue_trial(bad)
    s.optimize(obj, n_trials=1)
    t = s.trials[0]
    assert t.state.name == "PRUNED" and t.user_attrs["status"] == "invalid"
    assert "multiple of 16*warps=128" in t.user_attrs["reason"]
    assert measure.calls == []


def test_repeated_suggestions_are_memoised():
    measure = FakeMeasure()
    obj = Objective(FAM, PROBLEM, measure, SMEM)
    s = optuna.create_study()
    point = FAM.point(DEFAULT)
    for _ in range(3):
        s.enqueue_trial(point)
    s.optimize(obj, n_trials=3)
    assert measure.calls == [DEFAULT]
    assert [t.value for t in s.trials] == [model_ms(DEFAULT)] * 3
    assert [t.user_attrs.get("memo_of") for t in s.trials] == [None, 0, 0]
    assert all(t.user_attrs["config"] == DEFAULT.name for t in s.trials)
    assert s.trials[0].user_attrs["tflops"] == pytest.approx(FAM.flops(PROBLEM) / model_ms(DEFAULT) / 1e9)


@pytest.mark.parametrize("status", ["wrong", "compile_error", "launch_error", "timeout"])
def test_failed_measurements_are_pruned_and_recorded(status):
    measure = FakeMeasure(fail={DEFAULT.name: status})
    obj = Objective(FAM, PROBLEM, measure, SMEM)
    s = optuna.create_study()
    s.enqueue_trial(FAM.point(DEFAULT))
    s.enqueue_trial(FAM.point(DEFAULT))
    s.optimize(obj, n_trials=2)
    assert [t.state.name for t in s.trials] == ["PRUNED", "PRUNED"]
    assert [t.user_attrs["status"] for t in s.trials] == [status, status]
    assert len(measure.calls) == 1


def test_a_measure_that_raises_does_not_crash_the_study():
    def explode(cfg):
        raise RuntimeError("driver on fire")

    s = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    s.optimize(Objective(FAM, PROBLEM, explode, SMEM), n_trials=5)
    measured = [t for t in s.trials if t.user_attrs.get("status") == "error"]
    assert measured and all("driver on fire" in t.user_attrs["reason"] for t in measured)
    assert all(t.state.name == "PRUNED" for t in s.trials)
    bogus = Objective(FAM, PROBLEM, lambda cfg: 1.0, SMEM)
    assert bogus._measure(DEFAULT).status == "error"


# ---------------------------------------------------------------------------------------
# whole studies

def test_tpe_study_finds_the_best_and_starts_with_the_heuristic():
    outcome, measure = study(n_trials=60)
    s = outcome.study
    assert s.trials[0].params == FAM.point(DEFAULT) and s.trials[0].user_attrs["heuristic"]
    assert outcome.best == BEST and outcome.best_ms == pytest.approx(model_ms(BEST))
    assert len(measure.calls) == len(set(measure.calls)) <= len(VALID)
    assert outcome.counts.get("invalid", 0) + outcome.counts["ok"] + outcome.counts.get("memo", 0) \
        == outcome.n_trials <= 60
    assert outcome.n_valid == len(VALID)
    assert outcome.default_result.median_ms == pytest.approx(model_ms(DEFAULT))
    text = outcome.summary()
    assert BEST.name in text and "(heuristic)" in text and "vs heuristic" in text
    e = outcome.entry({"code_hash": "x", "family_version": 7})
    assert isinstance(e, select.Entry)
    assert e.key == ("fwd", "fa2_fwd", "bf16", 128, True, (), 4096) == outcome.key
    assert e.config == FAM.point(BEST) and len(e.runners_up) == 3
    assert e.stamp == {"version": 7, "code_hash": "x"}                 # what was measured
    assert outcome.entry({}).stamp == select.current_stamp(FAM)        # else the running code
    assert e.tflops == pytest.approx(FAM.flops(PROBLEM) / model_ms(BEST) / 1e9)
    assert [r["median_ms"] for r in e.runners_up] == sorted(r["median_ms"] for r in e.runners_up)


def test_same_seed_same_search():
    a, _ = study(n_trials=20, seed=3)
    b, _ = study(n_trials=20, seed=3)
    assert [t.params for t in a.study.trials] == [t.params for t in b.study.trials]


def test_brute_force_measures_every_valid_point_once_and_stops():
    wrong = VALID[3]
    outcome, measure = study(sampler="brute", measure=FakeMeasure(fail={wrong.name: "wrong"}))
    assert sorted(measure.calls) == sorted(VALID)
    assert measure.calls[0] == DEFAULT
    assert outcome.n_trials == len(VALID) and outcome.stopped_because == "every valid config measured"
    assert outcome.best == min((c for c in VALID if c != wrong), key=model_ms)
    assert wrong not in [c for c, _ in outcome.ok]
    assert "wrong" in outcome.summary(top=len(VALID))


def test_fatal_gpu_error_stops_the_study():
    outcome, measure = study(sampler="brute", measure=FakeMeasure(fatal_on=2))
    assert len(measure.calls) == 2 and outcome.stopped_because.startswith("GPU unusable")


def test_timeout_and_nothing_measured():
    outcome, measure = study(n_trials=50, timeout=0.0)
    assert outcome.n_trials <= 1
    none = run_study(FAM, PROBLEM, FakeMeasure(fail={c.name: "compile_error" for c in VALID}),
                     max_smem=SMEM, sampler="brute", log=lambda *a: None)
    assert none.best is None and none.entry({}) is None and "compile_error" in none.summary()


# ---------------------------------------------------------------------------------------
# resuming from the journal

def test_resume_continues_the_budget_without_re_measuring(tmp_path):
    journal = tmp_path / "j.log"
    first, m1 = study(n_trials=6, storage=str(journal), study_name="s")
    second, m2 = study(n_trials=20, storage=str(journal), study_name="s")
    assert second.n_trials == 20 and len(second.study.trials) == 20
    assert not set(m1.calls) & set(m2.calls), "a config measured before was measured again"
    assert second.study.trials[0].params == FAM.point(DEFAULT)
    # a finished study resumes to nothing
    third, m3 = study(n_trials=20, storage=str(journal), study_name="s")
    assert m3.calls == [] and len(third.study.trials) == 20


def test_brute_force_resumes_after_ctrl_c(tmp_path):
    journal = str(tmp_path / "j.log")
    with pytest.raises(KeyboardInterrupt):
        study(sampler="brute", storage=journal, study_name="b", measure=FakeMeasure(interrupt_on=4))
    outcome, measure = study(sampler="brute", storage=journal, study_name="b")
    assert len(measure.calls) == len(VALID) - 3          # the interrupted point measured again
    assert len(outcome.ranked) == len(VALID) and outcome.best == BEST


KILLED_RUN = """
import optuna, sys
optuna.logging.set_verbosity(optuna.logging.WARNING)
from cuflash import registry
from cuflash.tuning.fake import FakeMeasure
from cuflash.tuning.space import bench_problem
from cuflash.tuning.study import run_study
fam = registry.get("fa2_fwd")
p = bench_problem(fam, "bf16", 128, True, 4096)
run_study(fam, p, FakeMeasure(kill_on=int(sys.argv[2])), max_smem={smem},
          sampler=sys.argv[3], n_trials=30, seed=0, storage=sys.argv[1], study_name="k")
"""


@pytest.mark.parametrize("sampler", ["tpe", "brute"])
def test_resume_after_kill_loses_no_trial(tmp_path, sampler):
    journal = tmp_path / "j.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN.format(smem=SMEM), str(journal), "5", sampler],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    store = open_storage(str(journal))
    before = optuna.load_study(study_name="k", storage=store)
    running = [t for t in before.trials if t.state.name == "RUNNING"]
    assert len(running) == 1, "the kill should leave the trial it was measuring RUNNING"
    killed = running[0].params
    done = [t for t in before.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert sum(1 for t in done if "memo_of" not in t.user_attrs and t.user_attrs["status"] == "ok") == 4

    outcome, measure = study(sampler=sampler, n_trials=30, storage=str(journal), study_name="k")
    trials = outcome.study.trials
    assert trials[running[0].number].state.name == "FAIL"
    assert trials[running[0].number].user_attrs["interrupted"] is True
    assert killed in [FAM.point(c) for c in measure.calls], "the killed point was not re-measured"
    measured_before = {tuple(t.params[k] for k in KEYS) for t in done if t.user_attrs["status"] == "ok"}
    assert not measured_before & {point_key(FAM, c) for c in measure.calls}
    assert {t.number for t in done} <= {t.number for t in trials if t.state.name in ("COMPLETE", "PRUNED")}
    if sampler == "brute":
        assert len(outcome.ranked) == len(VALID) and outcome.best == BEST


# ---------------------------------------------------------------------------------------
# records on disk

def test_trials_json_and_plots(tmp_path):
    outcome, _ = study(sampler="brute", measure=FakeMeasure(fail={VALID[2].name: "wrong"}))
    path = write_trials(tmp_path / "t" / "s.json", outcome, sampler="brute", max_smem=SMEM,
                        gpu={"name": "G", "cc": "9.0"}, env={"code_hash": "h"})
    doc = json.loads(path.read_text())
    assert doc["format"] == 2 and doc["family"] == "fa2_fwd" and doc["family_version"] == FAM.version
    assert doc["key"] == ["fwd", "fa2_fwd", "bf16", 128, True, [], 4096]
    assert doc["problem"]["seqlen_q"] == 4096 and doc["problem"]["op"] == "fwd"
    assert doc["space"] == {k: list(v) for k, v in FAM.space.items()}
    assert doc["default"] == FAM.point(DEFAULT) and doc["n_valid"] == len(VALID)
    statuses = {t["config"]: t["status"] for t in doc["trials"]}
    assert statuses[VALID[2].name] == "wrong" and statuses[BEST.name] == "ok"
    assert all(t["state"] in ("COMPLETE", "PRUNED") for t in doc["trials"])
    plots = write_plots(outcome.study, tmp_path / "plots", "s", log=lambda *a: None)
    try:
        import matplotlib  # noqa: F401
        assert any(p.name == "s_history.png" for p in plots)
    except ImportError:
        assert plots == []


def test_trial_result_attrs_round_trip():
    r = TrialResult("ok", 1.5, "", 0.25, {"registers": 168})
    assert TrialResult.from_attrs(r.attrs()) == r and r.ok
    assert not TrialResult("ok", float("nan")).ok and not TrialResult("wrong", 1.0).ok


# ---------------------------------------------------------------------------------------
# the margin rule: the heuristic stays unless the best beats it by min_gain

def scripted(times: dict, default_ms=1.0, fail: dict = None):
    """A measurement: the heuristic at default_ms, configs named in `times` at their time,
    every other config 1.5x slower; names in `fail` fail with that status."""
    fail = fail or {}

    def measure(cfg):
        if cfg.name in fail:
            return TrialResult(fail[cfg.name], reason=f"scripted {fail[cfg.name]}")
        if cfg == DEFAULT:
            return TrialResult("ok", default_ms)
        return TrialResult("ok", times.get(cfg.name, 1.5 * default_ms))
    return measure


OTHER = next(c for c in VALID if c != DEFAULT)


def test_best_faster_than_the_margin_is_kept():
    outcome, _ = study(sampler="brute", measure=scripted({OTHER.name: 1.0 / 1.05}))   # +5%
    assert outcome.min_gain == 0.01 and outcome.best == OTHER and outcome.chosen == OTHER
    e = outcome.entry({})
    assert e.config == FAM.point(OTHER) and e.median_ms == pytest.approx(1 / 1.05) and e.note == ""
    assert e.runners_up[0]["config"] == FAM.point(DEFAULT)
    assert "table entry: " + OTHER.name + " (+5.0% vs heuristic)" in outcome.summary()
    # the fake model's best is ~5% faster than the heuristic too
    outcome, _ = study(n_trials=60)
    assert outcome.chosen == BEST and outcome.entry({}).config == FAM.point(BEST)
    # a margin of 0 keeps any best, a caller's margin overrides the outcome's
    assert outcome.entry({}, min_gain=0.0).config == FAM.point(BEST)
    assert outcome.entry({}, min_gain=0.2).config == FAM.point(DEFAULT)


@pytest.mark.parametrize("best_ms", [1.0 / 1.005, 1.0, 0.99999])
def test_best_within_the_margin_keeps_the_heuristic(best_ms):
    outcome, _ = study(sampler="brute", measure=scripted({OTHER.name: best_ms}))
    assert outcome.best in (OTHER, DEFAULT) and outcome.chosen == DEFAULT
    e = outcome.entry({"code_hash": "h"})
    assert e.config == FAM.point(DEFAULT) and e.median_ms == pytest.approx(1.0)
    assert e.tflops == pytest.approx(FAM.flops(PROBLEM) / 1.0 / 1e9)
    if outcome.best == OTHER:
        # the real best still heads the runners-up, and the note says why it is not the entry
        assert e.runners_up[0]["config"] == FAM.point(OTHER)
        assert e.runners_up[0]["median_ms"] == pytest.approx(best_ms)
        assert e.note.startswith("heuristic kept: best " + OTHER.name.split("_", 4)[-1])
        assert "< min gain 1.0%" in e.note
        text = outcome.summary()
        assert OTHER.name in text.splitlines()[2]                 # ranked first
        assert "table entry: " + DEFAULT.name + "; heuristic kept" in text
    assert FAM.point(DEFAULT) not in [r["config"] for r in e.runners_up]
    # the note survives the YAML table
    assert select.Entry.from_dict(e.to_dict()) == e


@pytest.mark.parametrize("status", ["wrong", "compile_error"])
def test_failed_heuristic_keeps_the_best(status):
    outcome, _ = study(sampler="brute", min_gain=0.5,
                       measure=scripted({OTHER.name: 0.999}, fail={DEFAULT.name: status}))
    assert outcome.default_result.status == status and outcome.heuristic_ms is None
    assert outcome.chosen == outcome.best == OTHER
    e = outcome.entry({})
    assert e.config == FAM.point(OTHER) and e.note == f"best kept (heuristic {status}: scripted {status})"
    assert "table entry: " + OTHER.name + "; best kept (heuristic " in outcome.summary()


def test_unmeasured_heuristic_keeps_the_best():
    outcome, _ = study(n_trials=3)
    hacked = dataclasses.replace(outcome, default_result=None)
    assert hacked.chosen == hacked.best and hacked.entry({}).note == "best kept (heuristic not measured)"


def test_heuristic_as_best_has_no_note():
    outcome, _ = study(sampler="brute", measure=scripted({}, default_ms=0.5))
    assert outcome.best == outcome.chosen == DEFAULT
    e = outcome.entry({})
    assert e.note == "" and "note" not in e.to_dict()


# ---------------------------------------------------------------------------------------
# any registered family: the backward's study, and study names

def test_backward_family_brute_force_study():
    bwd = registry.get("fa2_bwd")
    p = bench_problem(bwd, "bf16", 128, False, 16384)
    valid = bwd.valid(p, SMEM)
    outcome = run_study(bwd, p, FakeMeasure(), max_smem=SMEM, sampler="brute", log=lambda *a: None)
    assert outcome.n_valid == len(valid) and len(outcome.ranked) == len(valid)
    assert outcome.default_config == bwd.heuristic(p, (9, 0), SMEM)
    assert outcome.best == min(valid, key=model_ms)
    e = outcome.entry({})
    assert e.key == ("bwd", "fa2_bwd", "bf16", 128, False, (), 16384)
    assert set(e.config) == set(bwd.space) and e.stamp == select.current_stamp(bwd)
    assert outcome.flops == bwd.flops(p) == 2.5 * FAM.flops(p.replace(op="fwd"))


def test_study_names_carry_the_key_gpu_version_and_code():
    assert study_name_for(FAM, PROBLEM) == "fwd_fa2_fwd_bf16_d128_causal_s4096"
    assert study_name_for(FAM, PROBLEM, "NVIDIA H100 80GB HBM3", "78d8ed59d96ff5b0") == \
        f"fwd_fa2_fwd_bf16_d128_causal_s4096_NVIDIA_H100_80GB_HBM3_v{FAM.version}_78d8ed59"
