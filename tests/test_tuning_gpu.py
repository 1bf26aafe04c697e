"""The tuner on a real GPU: a short forward study that writes a tuned entry and then
finds it through selection; the backward measurement of one config; the tune command."""
import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

import cuflash  # noqa: E402
from cuflash import _gpu, reference, registry, select  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.tuning.space import bench_problem  # noqa: E402
from cuflash.tuning.table import save_entries  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(select.ENV_VAR, str(tmp_path / "tuned"))
    select.clear_cache()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield tmp_path / "tuned"
    select.clear_cache()


def test_short_forward_study_writes_and_uses_a_tuned_entry(tmp_path, tuned_dir):
    import ml_dtypes

    from cuflash.tuning.measure import GpuMeasure, env_record
    from cuflash.tuning.study import run_study, study_name_for, write_trials

    fam = registry.get("fa2_fwd")
    p = bench_problem(fam, "bf16", 64, False, 512)
    measure = GpuMeasure(fam, p, reps=5, warmup=1, seed=0)
    env = env_record(fam)
    outcome = run_study(fam, p, measure, max_smem=_gpu.max_smem(), arch=_gpu.arch(), n_trials=5,
                        seed=0, storage=str(tmp_path / "j.log"),
                        study_name=study_name_for(fam, p, _gpu.name(), env["code_hash"]), log=print)
    print(outcome.summary())
    assert not measure.fatal
    statuses = {r.status for _, r in outcome.ranked}
    assert statuses == {"ok"}, outcome.summary()
    assert outcome.study.trials[0].params == fam.point(outcome.default_config)
    first = outcome.ranked[0][1]
    assert first.extra["max_err"] <= 2 * first.extra["lowp_err"] + 1e-5
    assert first.extra["reps"] == 5 and first.extra["registers"] > 0
    assert 0 < outcome.best_ms < 100
    write_trials(tmp_path / "t.json", outcome, sampler="tpe", max_smem=_gpu.max_smem())

    for field in ("gpu", "cc", "driver", "cuda_runtime", "cupy", "cuflash", "family_version",
                  "code_hash"):
        assert env[field] != "" and "unknown" not in str(env[field]), (field, env[field])
    assert env["code_hash"] == select.current_stamp(fam)["code_hash"]
    entry = outcome.entry(env)
    assert entry.stamp == select.current_stamp(fam)
    path = save_entries([entry], _gpu.name(), _gpu.arch())
    assert path.parent == tuned_dir
    cfg, source = select.lookup(fam, Problem("fwd", "bf16", 1, 600, 600, 1, 1, 64, False),
                                _gpu.name(), _gpu.arch(), _gpu.max_smem())
    assert cfg == outcome.chosen and str(path) in source   # the best, or the heuristic by margin
    # selection finds it: choose() kept to the family on any GPU, and cuflash.config_for where
    # fa2_fwd is the forward chosen (not on sm_90, where sm90_fwd outranks it)
    p512 = Problem("fwd", "bf16", 1, 512, 512, 1, 1, 64, False)
    _, cfg2, source2 = select.choose(p512, _gpu.arch(), _gpu.name(), _gpu.max_smem(), family=fam)
    assert cfg2 == cfg and source2.startswith("tuned")
    if select.choose(p512, _gpu.arch())[0] is fam:
        cfg3, source3 = cuflash.config_for(64, "bf16", False, seqlen=512, with_source=True)
        assert cfg3 == cfg and source3.startswith("tuned")

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 333, 2, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out = cuflash.flash_attn_func(q, k, v, config=cfg)
    ref = reference.attention_naive(q, k, v)
    low = reference.lowp_attention(q, k, v, dtype=ml_dtypes.bfloat16)
    assert np.abs(out.astype(np.float64) - ref).max() <= 2 * np.abs(low - ref).max() + 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_backward_measure_of_the_heuristic(causal):
    from cuflash.tuning.measure import GpuMeasure

    fam = registry.get("fa2_bwd")
    p = bench_problem(fam, "bf16", 64, causal, 512)
    cfg = fam.heuristic(p, _gpu.arch(), _gpu.max_smem())
    res = GpuMeasure(fam, p, reps=5, warmup=1, seed=0)(cfg)
    assert res.ok, res
    for g in ("dq", "dk", "dv"):
        assert res.extra[f"{g}_err"] <= 3 * res.extra[f"{g}_lowp_err"] + 1e-4


def test_a_wrong_config_is_caught_by_verification(monkeypatch):
    """A config whose results are wrong is recorded as such, not timed: the forward runner
    compares against the float64 reference (here: the kernel's output is corrupted)."""
    from cuflash.tuning import measure as m

    fam = registry.get("fa2_fwd")
    p = bench_problem(fam, "fp16", 64, True, 512)
    cfg = fam.heuristic(p, _gpu.arch(), _gpu.max_smem()).replace(stages=3)
    real = cuflash.flash_attn_func

    def corrupt(*a, **kw):
        res = real(*a, **kw)
        out = res[0] if isinstance(res, tuple) else res
        out[:, :1] += 1
        return res

    monkeypatch.setattr(cuflash, "flash_attn_func", corrupt)
    m.GpuMeasure._checked.clear()
    res = m.GpuMeasure(fam, p, reps=3, warmup=1, seed=0)(cfg)
    m.GpuMeasure._checked.clear()
    assert res.status == "wrong" and "max|O - ref|" in res.reason


def test_tune_command_end_to_end(tmp_path, tuned_dir):
    from cuflash.tuning.cli import tune_main

    lines = []
    rc = tune_main(["--op", "fwd,bwd", "--dtype", "fp16", "--hdim", "64", "--causal", "true",
                    "--seqlen", "1000", "--trials", "3", "--reps", "3", "--no-progress", "--no-precompile",
                    "--out", str(tmp_path / "results"), "--storage", str(tmp_path / "j.log"),
                    "--seed", "0"], log=lines.append)
    print("\n".join(lines))
    assert rc == 0
    files = list(tuned_dir.glob("*.yaml"))
    assert len(files) == 1 and files[0].name == select.file_name(_gpu.name(), _gpu.arch())
    tf = select.read_file(files[0])
    # every family that runs the problem on this GPU (sm90_fwd too on sm_90)
    arch = tuple(_gpu.arch())
    want = sorted((f.op, f.name, "fp16", 64, True, (), 1024) for f in registry.families()
                  if not f.supports(arch, Problem.fa_convention(f.op, "fp16", 64, True, 1000)))
    assert {"fa2_fwd", "fa2_bwd"} <= {k[1] for k in want}
    assert sorted(e.key for e in tf.entries) == want
    assert list((tmp_path / "results").rglob("fwd_fa2_fwd_fp16_d64_causal_s1024_*.json"))
    assert list((tmp_path / "results").rglob("bwd_fa2_bwd_fp16_d64_causal_s1024_*.json"))
    for op in ("fwd", "bwd"):
        fam, cfg, source = select.choose_on_device(
            Problem(op, "fp16", 1, 1000, 1000, 1, 1, 64, True), 0)
        assert source.startswith("tuned"), source


def test_bench_timing_and_the_interleaved_re_time():
    """The tuner's default timing (back-to-back samples, tuning/measure.py) and ``compare``:
    both give finite times for the heuristic and a neighbour, and agree within 15%."""
    from cuflash.tuning.measure import GpuMeasure

    fam = registry.get("fa2_fwd")
    p = bench_problem(fam, "bf16", 64, False, 512)
    cfg = fam.heuristic(p, _gpu.arch(), _gpu.max_smem())
    other = cfg.replace(stages=3) if not cfg.replace(stages=3).problems(_gpu.max_smem()) else cfg.replace(stages=2)
    m = GpuMeasure(fam, p, reps=5, warmup=1, seed=0)
    assert m.timing == "bench"
    a, b = m(cfg), m(other)
    assert a.ok and b.ok, (a, b)
    assert a.extra["timing"] == "bench" and 2 <= a.extra["back_to_back"] <= 10
    both = m.compare([cfg, other])
    assert set(both) == {cfg, other} and all(0 < t < 100 for t in both.values())
    assert abs(both[cfg] / a.median_ms - 1) < 0.15
    flushed = GpuMeasure(fam, p, reps=5, warmup=1, seed=0, timing="flush")(cfg)
    assert flushed.ok and flushed.extra["back_to_back"] == 1


def test_tune_with_candidates_on_sm90(tmp_path, tuned_dir):
    """The final tune's form (--candidates, bench timing, confirmation) on one sm90_fwd study."""
    if tuple(_gpu.arch()) != (9, 0):
        pytest.skip("sm90_fwd runs on sm_90 only")
    from cuflash.tuning.cli import tune_main

    lines = []
    rc = tune_main(["--family", "sm90_fwd", "--dtype", "bf16", "--hdim", "256", "--causal", "false",
                    "--seqlen", "2048", "--candidates", "2", "--reps", "5", "--no-progress", "--no-plots",
                    "--out", str(tmp_path / "results"), "--storage", str(tmp_path / "j.log"),
                    "--seed", "0"], log=lines.append)
    text = "\n".join(lines)
    print(text)
    # the re-time runs only where the study would replace the heuristic
    assert rc == 0 and "estimate: 1 studies" in text
    assert "re-timed together: " in text or "best (is the heuristic)" in text or "heuristic kept" in text
    (e,) = select.read_file(next(tuned_dir.glob("*.yaml"))).entries
    assert e.family == "sm90_fwd" and e.env["timing"] == "bench"
