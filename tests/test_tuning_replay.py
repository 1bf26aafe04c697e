"""Replay (tuning/replay.py): samplers run against a recorded brute-force table, no GPU."""
import json

import pytest

optuna = pytest.importorskip("optuna")

from cuflash import registry  # noqa: E402
from cuflash.families.base import MAX_SMEM_BY_ARCH  # noqa: E402
from cuflash.tuning.fake import FakeMeasure, model_ms  # noqa: E402
from cuflash.tuning.replay import (Recorded, format_efficiency, main, replay,  # noqa: E402
                                   search_efficiency)
from cuflash.tuning.space import bench_problem  # noqa: E402
from cuflash.tuning.study import run_study, write_trials  # noqa: E402

SMEM = MAX_SMEM_BY_ARCH[(9, 0)]
FAM = registry.get("fa2_fwd")
PROBLEM = bench_problem(FAM, "bf16", 128, False, 16384)
VALID = FAM.valid(PROBLEM, SMEM)

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def brute_table(tmp_path_factory):
    fail = {VALID[1].name: "wrong", VALID[2].name: "compile_error"}
    outcome = run_study(FAM, PROBLEM, FakeMeasure(fail=fail), max_smem=SMEM, sampler="brute",
                        log=lambda *a: None)
    return write_trials(tmp_path_factory.mktemp("rec") / "brute.json", outcome, sampler="brute",
                        max_smem=SMEM)


def test_recorded_table_answers_like_the_gpu_did(brute_table):
    rec = Recorded.load(brute_table)
    valid = VALID
    assert rec.family is FAM and rec.problem == PROBLEM
    assert len(rec.results) == len(valid)
    assert rec(valid[1]).status == "wrong" and rec(valid[2]).status == "compile_error"
    best = min((c for c in valid[3:] + valid[:1]), key=model_ms)
    assert rec.best_ms == pytest.approx(model_ms(best))
    other = FAM.make(FAM.point(valid[0]), PROBLEM.replace(head_dim=64))   # a different problem
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


def test_format_1_recording_replays(brute_table, tmp_path):
    """A study recorded before the family registry (trial format 1: problem.kernel) still
    replays, as the FA2 family of that op."""
    doc = json.loads(brute_table.read_text())
    p = doc["problem"]
    doc.update(format=1, problem={"kernel": "fwd", "dtype": p["dtype"], "head_dim": p["head_dim"],
                                  "causal": p["causal"], "seqlen": p["seqlen_q"],
                                  "batch": p["batch"], "nheads": p["nheads"]})
    for k in ("family", "family_version", "key"):
        doc.pop(k)
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    rec = Recorded.load(path)
    assert rec.family is FAM and rec.problem == PROBLEM
    assert rec.best_ms == Recorded.load(brute_table).best_ms
    assert replay(rec, "tpe", seed=1) == replay(Recorded.load(brute_table), "tpe", seed=1)


def test_a_recording_of_another_space_is_refused(brute_table, tmp_path):
    doc = json.loads(brute_table.read_text())
    doc["space"]["Bx"] = [1]
    path = tmp_path / "x.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not the current fa2_fwd space"):
        Recorded.load(path)
