"""Replay (tuning/replay.py): samplers run against a recorded brute-force table, no GPU."""
import json

import pytest

optuna = pytest.importorskip("optuna")

import cuflash.config as cc  # noqa: E402
from tuning.fake import FakeMeasure, model_ms  # noqa: E402
from tuning.replay import Recorded, format_efficiency, main, replay, search_efficiency  # noqa: E402
from tuning.space import Problem, get_family  # noqa: E402
from tuning.study import run_study, write_trials  # noqa: E402

SMEM = cc.MAX_SMEM_BY_ARCH[(9, 0)]
FAM = get_family("fwd")

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def brute_table(tmp_path_factory):
    p = Problem.fa_convention("fwd", "bf16", 128, False, 16384)
    valid = FAM.valid(128, "bf16", False, SMEM)
    fail = {valid[1].name: "wrong", valid[2].name: "compile_error"}
    outcome = run_study(FAM, p, FakeMeasure(fail=fail), max_smem=SMEM, sampler="brute",
                        log=lambda *a: None)
    return write_trials(tmp_path_factory.mktemp("rec") / "brute.json", outcome, sampler="brute",
                        max_smem=SMEM)


def test_recorded_table_answers_like_the_gpu_did(brute_table):
    rec = Recorded.load(brute_table)
    valid = FAM.valid(128, "bf16", False, SMEM)
    assert len(rec.results) == len(valid)
    assert rec(valid[1]).status == "wrong" and rec(valid[2]).status == "compile_error"
    best = min((c for c in valid[3:] + valid[:1]), key=model_ms)
    assert rec.best_ms == pytest.approx(model_ms(best))
    other = FAM.make(FAM.params(valid[0]), 64, "bf16", False)     # a different problem
    assert rec(other).status == "ok"                                # looked up by point
    assert rec.calls == 3


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_replay_reaches_the_best_and_is_reproducible(brute_table, sampler):
    rec = Recorded.load(brute_table)
    a = replay(rec, sampler, seed=1)
    b = replay(Recorded.load(brute_table), sampler, seed=1)
    assert a == b
    assert 1 <= a["measured"] <= len(rec.results) and a["trials"] >= a["measured"]
    assert a["found_ms"] <= rec.best_ms * 1.02


def test_search_efficiency_averages_over_seeds(brute_table, tmp_path, capsys):
    res = search_efficiency(brute_table, "tpe", seeds=5)
    assert len(res["runs"]) == 5 and {r["seed"] for r in res["runs"]} == set(range(5))
    assert res["n_valid"] == res["recorded"]
    assert res["mean_measured"] == pytest.approx(sum(r["measured"] for r in res["runs"]) / 5)
    assert res["mean_fraction"] == pytest.approx(res["mean_measured"] / res["n_valid"])
    assert res["meets_bar"] == (res["mean_fraction"] <= 0.2)
    assert "tpe over 5 seeds" in format_efficiency(res)
    out = tmp_path / "eff.json"
    assert main([str(brute_table), "--sampler", "tpe,random", "--seeds", "5", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 2
    assert capsys.readouterr().out.count("seeds reaches within 2%") == 2


def table_with_best_as_heuristic(brute_table, tmp_path):
    """A copy of the recorded study whose heuristic (the first trial) is its best config."""
    doc = json.loads(brute_table.read_text())
    best = min((t for t in doc["trials"] if t["status"] == "ok"), key=lambda t: t["median_ms"])
    doc["default"] = best["params"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    return path


def test_heuristic_that_is_already_best_costs_one_measurement(brute_table, tmp_path):
    path = table_with_best_as_heuristic(brute_table, tmp_path)
    res = search_efficiency(path, "tpe", seeds=2)
    assert [r["measured"] for r in res["runs"]] == [1, 1] and res["meets_bar"]


def test_table_without_a_success_is_refused(brute_table, tmp_path):
    doc = json.loads(brute_table.read_text())
    for t in doc["trials"]:
        t["status"], t["median_ms"] = "wrong", None
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no successful measurement"):
        search_efficiency(path)


def test_sampler_alone_without_the_heuristic_head_start(brute_table, tmp_path):
    path = table_with_best_as_heuristic(brute_table, tmp_path)
    res = search_efficiency(path, "random", seeds=3, enqueue_default=False)
    assert not res["heuristic_first"] and "(no heuristic first)" in format_efficiency(res)
    assert any(r["measured"] > 1 for r in res["runs"])
