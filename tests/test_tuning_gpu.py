"""The tuner on a real GPU: a short forward study that writes a tuned entry and then
finds it through the lookup; the backward measurement of one config; the tune command."""
import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

import cuflash  # noqa: E402
from cuflash import _gpu, reference  # noqa: E402
from tuning import table  # noqa: E402
from tuning.space import Problem, families, get_family  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(table.ENV_VAR, str(tmp_path / "tuned"))
    table.clear_cache()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield tmp_path / "tuned"
    table.clear_cache()


def test_short_forward_study_writes_and_uses_a_tuned_entry(tmp_path, tuned_dir):
    import ml_dtypes

    from tuning.measure import GpuMeasure, env_record
    from tuning.study import run_study, study_name_for, write_trials

    fam = get_family("fwd")
    p = Problem.fa_convention("fwd", "bf16", 64, False, 512)
    measure = GpuMeasure(fam, p, reps=5, warmup=1, seed=0)
    env = env_record(fam)
    outcome = run_study(fam, p, measure, max_smem=_gpu.max_smem(), arch=_gpu.arch(), n_trials=5,
                        seed=0, storage=str(tmp_path / "j.log"),
                        study_name=study_name_for(p, _gpu.name(), env["source_hash"]), log=print)
    print(outcome.summary())
    assert not measure.fatal
    statuses = {r.status for _, r in outcome.ranked}
    assert statuses == {"ok"}, outcome.summary()
    assert outcome.study.trials[0].params == fam.params(outcome.default_config)
    first = outcome.ranked[0][1]
    assert first.extra["max_err"] <= 2 * first.extra["lowp_err"] + 1e-5
    assert 0 < outcome.best_ms < 100
    write_trials(tmp_path / "t.json", outcome, sampler="tpe", max_smem=_gpu.max_smem())

    for field in ("gpu", "cc", "driver", "cuda_runtime", "cupy", "cuflash", "source_hash"):
        assert env[field] and "unknown" not in str(env[field]), (field, env[field])
    path = table.save_entries([outcome.entry(env)], _gpu.name(), _gpu.arch())
    assert path.parent == tuned_dir
    cfg, source = table.lookup("fwd", _gpu.name(), _gpu.arch(), "bf16", 64, False, 600,
                               _gpu.max_smem())
    assert cfg == outcome.chosen and str(path) in source   # the best, or the heuristic by margin
    cfg2, source2 = table.choose("fwd", 64, "bf16", False, 512, gpu_name=_gpu.name(),
                                 cc=_gpu.arch(), max_smem=_gpu.max_smem())
    assert cfg2 == cfg and source2.startswith("tuned")

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 333, 2, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out = cuflash.flash_attn_func(q, k, v, config=cfg)
    ref = reference.attention_naive(q, k, v)
    low = reference.lowp_attention(q, k, v, dtype=ml_dtypes.bfloat16)
    assert np.abs(out.astype(np.float64) - ref).max() <= 2 * np.abs(low - ref).max() + 1e-5


@pytest.mark.skipif("bwd" not in families(), reason="no backward kernel yet")
def test_backward_measure_of_the_heuristic():
    from cuflash import interface
    from tuning.measure import GpuMeasure

    if not hasattr(interface, "flash_attn_backward"):
        pytest.skip("cuflash.interface has no flash_attn_backward yet")
    fam = get_family("bwd")
    p = Problem.fa_convention("bwd", "bf16", 64, True, 512)
    cfg = fam.heuristic(64, "bf16", True, _gpu.arch(), _gpu.max_smem())
    res = GpuMeasure(fam, p, reps=5, warmup=1, seed=0)(cfg)
    assert res.ok, res
    assert res.extra["dq_err"] <= 3 * res.extra["dq_lowp_err"] + 1e-4


def test_tune_command_end_to_end(tmp_path, tuned_dir):
    from tuning.cli import tune_main

    lines = []
    rc = tune_main(["--kernel", "fwd", "--dtype", "fp16", "--hdim", "64", "--causal", "true",
                    "--seqlen", "1000", "--trials", "3", "--reps", "3", "--no-progress",
                    "--out", str(tmp_path / "results"), "--storage", str(tmp_path / "j.log"),
                    "--seed", "0"], log=lines.append)
    print("\n".join(lines))
    assert rc == 0
    files = list(tuned_dir.glob("*.yaml"))
    assert len(files) == 1
    tf = table.read_file(files[0])
    assert [e.key for e in tf.entries] == [("fwd", "fp16", 64, True, 1024)]
    assert list((tmp_path / "results").rglob("fwd_fp16_d64_causal_s1024_*.json"))
