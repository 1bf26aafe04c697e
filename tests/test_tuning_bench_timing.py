"""The tuner's bench-like timing, its confirming re-time and its fixed candidate lists
(tuning/measure.py, study.py, space.py, cli.py), CPU only: optuna with the deterministic fake."""
import pytest

optuna = pytest.importorskip("optuna")

from cuflash import registry, select  # noqa: E402
from cuflash.families.base import MAX_SMEM_BY_ARCH  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.tuning import cli, measure  # noqa: E402
from cuflash.tuning.fake import FakeCompareMeasure, FakeMeasure, model_ms  # noqa: E402
from cuflash.tuning.space import bench_problem, candidates, point_key  # noqa: E402
from cuflash.tuning.study import CONFIRM_TOP, run_study  # noqa: E402

SMEM = MAX_SMEM_BY_ARCH[(9, 0)]
FAM = registry.get("fa2_fwd")
PROBLEM = bench_problem(FAM, "bf16", 128, True, 4096)
DEFAULT = FAM.heuristic(PROBLEM, (9, 0), SMEM)
BEST = min(FAM.valid(PROBLEM, SMEM), key=model_ms)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study(measure, **kw):
    args = dict(max_smem=SMEM, arch=(9, 0), seed=0, log=lambda *a: None, sampler="brute")
    args.update(kw)
    return run_study(FAM, PROBLEM, measure, **args)


def test_bench_calls_follow_the_bench_and_shorten_long_calls():
    assert measure.bench_calls(0.4) == measure.BENCH_BACK_TO_BACK == 10
    assert measure.bench_calls(3.2) == 7              # 25 ms of calls
    assert measure.bench_calls(12.0) == 2             # never fewer than 2: back to back
    assert measure.bench_calls(100.0) == 2 and measure.bench_calls(0.0) == 10


def test_gpu_measure_refuses_an_unknown_timing_mode():
    with pytest.raises(ValueError, match="timing must be one of"):
        measure.GpuMeasure(FAM, PROBLEM, timing="cold")


def test_confirmation_that_agrees_changes_nothing():
    m = FakeCompareMeasure()
    out = study(m)
    assert m.compared and m.compared[0][0] == DEFAULT and len(m.compared[0]) == 1 + CONFIRM_TOP
    assert set(out.confirmed) == set(m.compared[0])
    assert out.chosen == BEST and out.entry({}).note == ""
    assert "re-timed together: " in out.summary()


def test_confirmation_keeps_the_heuristic_when_the_best_only_won_in_sequence():
    """The study's best is ~5% faster in its own trial, no faster re-timed next to the heuristic."""
    top = [c for c in study(FakeCompareMeasure()).confirmed if c != DEFAULT]
    m = FakeCompareMeasure(confirm_ms={c.name: model_ms(DEFAULT) * (0.995 if c == BEST else 1.02)
                                       for c in top})
    out = study(m)
    assert out.best == BEST and out.chosen == DEFAULT
    note = out.entry({}).note
    assert note.startswith("heuristic kept: best ") and "re-timed together" in note


def test_confirmation_can_pick_another_of_the_top_few():
    m = FakeCompareMeasure()
    out = study(m)
    second = [c for c in out.confirmed if c not in (DEFAULT, BEST)][0]
    m2 = FakeCompareMeasure(confirm_ms={second.name: 0.5})
    out2 = study(m2)
    assert out2.chosen == second
    e = out2.entry({})
    assert e.config == FAM.point(second) and e.median_ms == 0.5 and "re-timed together" in e.note


def test_no_confirmation_without_compare_or_when_switched_off():
    out = study(FakeMeasure())
    assert out.confirmed == {} and out.chosen == BEST
    m = FakeCompareMeasure(confirm_ms={BEST.name: 99.0})
    out = study(m, confirm=False)
    assert m.compared == [] and out.chosen == BEST
    # nor where the study keeps the heuristic anyway (the margin: the best is ~5% faster)
    m = FakeCompareMeasure()
    out = study(m, min_gain=0.5)
    assert m.compared == [] and out.chosen == DEFAULT


def test_fixed_points_are_measured_and_nothing_else():
    pts = candidates(FAM, [bench_problem(FAM, "bf16", 128, True, s) for s in (2048, 4096)], 4, SMEM)
    m = FakeMeasure()
    out = study(m, sampler="tpe", points=pts, confirm=False)
    assert m.calls[0] == DEFAULT
    assert {point_key(FAM, c) for c in m.calls} == {point_key(FAM, c) for c in pts}
    assert out.n_trials == len({point_key(FAM, c) for c in pts})


@pytest.mark.parametrize("name", ["fa2_fwd", "fa2_bwd", "sm90_fwd", "sm90_bwd"])
def test_candidates_are_valid_distinct_heuristics_first_and_seeded(name):
    fam = registry.get(name)
    ps = [bench_problem(fam, "bf16", 128, False, s) for s in (2048, 4096, 8192, 16384)]
    got = candidates(fam, ps, 6, SMEM, seed=1)
    heurs = list(dict.fromkeys(point_key(fam, fam.heuristic(p, (9, 0), SMEM)) for p in ps))
    keys = [point_key(fam, c) for c in got]
    assert keys[:len(heurs)] == heurs and len(set(keys)) == len(keys)
    assert len(got) <= len(heurs) + 6 and len(got) >= min(len(heurs) + 1, len(fam.valid(ps[-1], SMEM)))
    assert all(not c.problems(SMEM) for c in got)
    assert got == candidates(fam, ps, 6, SMEM, seed=1)
    assert candidates(fam, [], 6, SMEM) == []


def test_estimate_is_per_study_and_grows_with_the_problem():
    fam = registry.get("sm90_fwd")
    small, big = (Problem.fa_convention("fwd", "bf16", 128, False, s) for s in (2048, 16384))
    a, b = (cli.estimate_s(fam, p, 7, 10, True) for p in (small, big))
    assert 0 < a < b < 30
    assert cli.estimate_s(fam, big, 7, 10, False, verify=False) < b


def fake_tuning(monkeypatch, made):
    from tests.test_tuning_cli import fake_gpu

    fake_gpu(monkeypatch, (9, 0))

    def fake_measure(fam, p, device, **kw):
        made.append((fam, p, kw))
        return FakeCompareMeasure()

    monkeypatch.setattr(measure, "GpuMeasure", fake_measure)
    monkeypatch.setattr(measure, "env_record", lambda fam, device=0: {
        "family": fam.name, "family_version": fam.version,
        "code_hash": select.current_stamp(fam)["code_hash"], "gpu": "Fake GPU", "cc": "9.0"})


def test_tune_with_candidates_compiles_and_measures_the_fixed_lists(monkeypatch, tmp_path):
    made = []
    fake_tuning(monkeypatch, made)
    # the heuristic's stream_tail is outside the tuning space (no table entry where the heuristic has it):
    # off here, so that both sm90_fwd studies write their entry
    from cuflash.families import sm90_fwd

    monkeypatch.setattr(sm90_fwd, "HEURISTIC_STREAM_TAIL", frozenset())
    # the same for the backward's dq_first (the heuristic's up to 2k, outside the space)
    from cuflash.families import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DQ_FIRST", frozenset())
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_WIDE_EPI", frozenset())   # (wide_epi likewise, session 20)
    from cuflash import compile as cucompile

    seen = []

    def fake_precompile(configs, device_id=0, processes=None, progress=None):
        seen.extend(configs)
        return [(c, 0.0, "") for c in configs]

    monkeypatch.setattr(cucompile, "precompile", fake_precompile)
    lines = []
    args = ["--family", "sm90_fwd,sm90_bwd", "--dtype", "bf16", "--hdim", "128", "--seqlen",
            "2048,16384", "--causal", "false", "--candidates", "3", "--reps", "5", "--seed", "0",
            "--no-plots", "--no-progress", "--out", str(tmp_path / "r"), "--table-dir", str(tmp_path / "t")]
    assert cli.tune_main(args, log=lines.append) == 0
    text = "\n".join(lines)
    assert "candidates; timing bench" in text and "estimate: 4 studies ~" in text
    assert "estimate fwd_sm90_fwd_bf16_d128_full_s16384: " in text
    assert all(kw["timing"] == "bench" and kw["reps"] == 5 for _, _, kw in made) and len(made) == 4
    fams = {f.name for f, _, _ in made}
    assert fams == {"sm90_fwd", "sm90_bwd"}
    # the precompiled configs are the candidate lists, each once (the two buckets share them)
    pts = {name: candidates(registry.get(name), [Problem.fa_convention(registry.get(name).op, "bf16", 128,
                                                                         False, s) for s in (2048, 16384)],
                            3, SMEM, seed=0) for name in fams}
    assert len(seen) == len(set(seen)) and set(seen) == {c for v in pts.values() for c in v}
    tf = select.read_file(tmp_path / "t" / "Fake_GPU_sm90.yaml")
    assert sorted((e.family, e.seqlen) for e in tf.entries) == sorted(
        (f, s) for f in fams for s in (2048, 16384))
    assert all(e.env.get("timing") == "bench" for e in tf.entries)
    lines.clear()
    assert cli.tune_main(args + ["--timing", "flush", "--no-confirm"], log=lines.append) == 0
    assert made[-1][2]["timing"] == "flush"
    assert cli.tune_main(args + ["--brute-force"], log=lines.append) == 2
    assert lines[-1] == "cuflash tune: --candidates and --brute-force: choose one"


def test_round_orders_shuffle_every_predecessor():
    from cuflash.timing import ORDERS, round_orders

    names = ["sm90", "fa2", "flash", "cudnn"]
    assert round_orders(names, 3, "fixed") == [names] * 3
    rot = round_orders(names, 4, "rotate")
    assert rot[1] == ["fa2", "flash", "cudnn", "sm90"]
    shuf = round_orders(names, 20, "shuffle")
    assert shuf == round_orders(names, 20, "shuffle")             # seeded
    assert all(sorted(r) == sorted(names) for r in shuf)
    # in one continuous stream of rounds, cuDNN follows each of the others at least twice
    stream = [n for r in shuf for n in r]
    before = [a for a, b in zip(stream, stream[1:]) if b == "cudnn"]
    assert all(before.count(n) >= 2 for n in names if n != "cudnn"), before
    with pytest.raises(ValueError, match="order must be one of"):
        round_orders(names, 2, "random")
    assert ORDERS[0] == "shuffle"


def test_no_entry_that_would_lose_the_heuristics_fields(monkeypatch):
    """A heuristic with a field outside the space (sm90_fwd's q_double, a heuristic switch): the
    study keeps it, and entry() writes nothing rather than a point that would build another config."""
    from cuflash.tuning.objective import TrialResult

    fam = registry.get("sm90_fwd")
    p = bench_problem(fam, "bf16", 64, True, 2048)
    real = fam.heuristic(p, (9, 0), SMEM)
    monkeypatch.setattr(type(fam), "heuristic", lambda self, problem, arch=(9, 0), max_smem=None:
                        real.replace(q_double=True))
    pts = candidates(fam, [p], 2, SMEM)
    seen = []
    out = run_study(fam, p, lambda cfg: seen.append(cfg) or TrialResult("ok", 1.0), max_smem=SMEM,
                    points=pts, log=lambda *a: None)
    assert out.heuristic_outside_space and out.chosen.q_double
    assert seen[0] == real.replace(q_double=True)             # the heuristic itself was measured
    assert out.entry({}) is None
    # a heuristic inside the space (this problem's real one takes q_double: HEURISTIC_D64_Q_DOUBLE)
    monkeypatch.setattr(type(fam), "heuristic", lambda self, problem, arch=(9, 0), max_smem=None:
                        real.replace(q_double=False))
    out = run_study(fam, p, lambda cfg: TrialResult("ok", 1.0), max_smem=SMEM, points=pts,
                    log=lambda *a: None)
    assert not out.heuristic_outside_space and out.entry({}) is not None
