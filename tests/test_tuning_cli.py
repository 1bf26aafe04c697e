"""python -m cuflash tune / info (tuning/cli.py) without a GPU, and the tune loop with the
GPU parts replaced by the deterministic fake. CPU only."""
import subprocess
import sys
from pathlib import Path

import pytest

import cuflash.config as cc
from cuflash import _gpu
from tuning import cli, table

REPO = Path(__file__).resolve().parent.parent
needs_no_gpu = pytest.mark.skipif(_gpu.available(), reason="a GPU is usable here")


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(table.ENV_VAR, str(tmp_path / "user"))
    monkeypatch.setattr(table, "SHIPPED_DIR", tmp_path / "shipped")
    table.clear_cache()
    yield
    table.clear_cache()


def test_parser_reads_lists():
    a = cli.tune_parser().parse_args(["--dtype", "bf16", "--hdim", "64,128", "--seqlen",
                                      "512,3000", "--causal", "true", "--brute-force"])
    assert (a.dtype, a.hdim, a.seqlen, a.causal, a.brute_force) == \
        (["bf16"], [64, 128], [512, 3000], "true", True)
    assert a.min_gain == 1.0                                   # percent
    assert cli.tune_parser().parse_args(["--min-gain", "2.5"]).min_gain == 2.5
    assert "--min-gain" in cli.tune_parser().format_help()


@needs_no_gpu
def test_tune_without_gpu_fails_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cuflash", "tune", "--kernel", "fwd"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cuflash tune: no GPU here (")
    assert "Traceback" not in proc.stderr


@needs_no_gpu
def test_info_without_gpu_prints_what_it_can(capsys):
    from cuflash.__main__ import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cuflash ") and "flash_fwd" in out
    assert "tuned tables (searched in this order)" in out and "GPU: none (" in out


def test_info_lists_tables_and_the_config_in_force(monkeypatch, tmp_path):
    stamp = table.current_stamp("fwd")
    e = table.Entry("fwd", "bf16", 128, True, 4096, {"Br": 128, "Bc": 64, "warps": 4, "stages": 3},
                    1.0, 300.0, [], dict(stamp))
    path = table.save_entries([e], "Fake GPU", (9, 0))
    (path.parent / "junk.yaml").write_text("[[[")
    fake_gpu(monkeypatch)
    with pytest.warns(table.TunedTableWarning, match="junk.yaml"):
        lines = cli.info_lines()
    text = "\n".join(lines)
    assert "GPU: Fake GPU, sm_90" in text
    assert "Fake_GPU_sm90.yaml: Fake GPU sm_90, 1 entries (fwd)" in text
    assert "junk.yaml: unusable" in text
    tuned = [ln for ln in lines if "fwd bf16 d=128 causal=True " in ln]
    assert len(tuned) == 6 and all("Br128_Bc64_w4_s3" in ln and "tuned" in ln for ln in tuned)
    assert any("fwd fp16 d=64" in ln and "<- heuristic" in ln for ln in lines)


def fake_gpu(monkeypatch):
    monkeypatch.setattr(_gpu, "why_unavailable", lambda: "")
    monkeypatch.setattr(_gpu, "name", lambda device=0: "Fake GPU")
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (9, 0))
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: cc.MAX_SMEM_BY_ARCH[(9, 0)])


def test_tune_loop_with_a_fake_gpu(monkeypatch, tmp_path):
    pytest.importorskip("optuna")
    from tuning import fake, measure

    fake_gpu(monkeypatch)
    monkeypatch.setattr(measure, "GpuMeasure", lambda fam, p, device, **kw: fake.FakeMeasure())
    monkeypatch.setattr(measure, "env_record", lambda fam, device=0: dict(
        table.current_stamp(fam.kernel), gpu="Fake GPU", cc="9.0"))
    lines = []
    args = ["--kernel", "fwd", "--dtype", "bf16", "--hdim", "128", "--seqlen", "512,16384",
            "--causal", "false", "--trials", "8", "--seed", "0", "--no-progress", "--no-plots", "--no-precompile",
            "--out", str(tmp_path / "res"), "--table-dir", str(tmp_path / "ship")]
    assert cli.tune_main(args, log=lines.append) == 0
    text = "\n".join(lines)
    assert "[2/2] fwd_bf16_d128_full_s16384_Fake_GPU_" in text and "vs heuristic" in text
    tf = table.read_file(tmp_path / "ship" / "Fake_GPU_sm90.yaml")
    assert sorted(e.seqlen for e in tf.entries) == [512, 16384]
    assert len(list((tmp_path / "res" / "Fake_GPU" / "tuning").glob("*.json"))) == 2
    assert (tmp_path / "res" / "Fake_GPU" / "tuning" / "studies.journal").exists()
    cfg, source = table.choose("fwd", 128, "bf16", False, 16384, gpu_name="Fake GPU", cc=(9, 0),
                               dirs=[tmp_path / "ship"])
    assert source.startswith("tuned") and cfg.Br == 128
    # re-running resumes: nothing new is measured, the same table comes out
    lines.clear()
    assert cli.tune_main(args, log=lines.append) == 0
    text = "\n".join(lines)
    assert text.count("configs already measured, 0 queued again)") == 2
    assert table.read_file(tmp_path / "ship" / "Fake_GPU_sm90.yaml").entries == tf.entries


def test_tune_refuses_bad_input(monkeypatch):
    pytest.importorskip("optuna")
    fake_gpu(monkeypatch)
    lines = []
    assert cli.tune_main(["--dtype", "fp32"], log=lines.append) == 2
    assert lines == ["cuflash tune: --dtype must be bf16 and/or fp16, got ['fp32']"]


def test_tune_min_gain_keeps_the_heuristic(monkeypatch, tmp_path):
    """The fake's best is ~5% faster than the heuristic: --min-gain 1 (default) writes the
    best, --min-gain 20 keeps the heuristic and says so; the best still shows in the log."""
    pytest.importorskip("optuna")
    from tuning import fake, measure

    fake_gpu(monkeypatch)
    monkeypatch.setattr(measure, "GpuMeasure", lambda fam, p, device, **kw: fake.FakeMeasure())
    monkeypatch.setattr(measure, "env_record", lambda fam, device=0: dict(
        table.current_stamp(fam.kernel), gpu="Fake GPU", cc="9.0"))
    heuristic = cc.default_fwd_config(128, "bf16", False, (9, 0), cc.MAX_SMEM_BY_ARCH[(9, 0)])
    common = ["--kernel", "fwd", "--dtype", "bf16", "--hdim", "128", "--seqlen", "4096",
              "--causal", "false", "--brute-force", "--no-progress", "--no-plots", "--no-precompile"]
    entries = {}
    for gain in ("1", "20"):
        lines = []
        args = common + ["--min-gain", gain, "--out", str(tmp_path / f"res{gain}"),
                         "--table-dir", str(tmp_path / f"t{gain}")]
        assert cli.tune_main(args, log=lines.append) == 0
        (e,) = table.read_file(tmp_path / f"t{gain}" / "Fake_GPU_sm90.yaml").entries
        entries[gain] = (e, "\n".join(lines))
    best, text = entries["1"]
    assert best.config != {k: getattr(heuristic, k) for k in best.config} and best.note == ""
    kept, text = entries["20"]
    assert kept.config == {k: getattr(heuristic, k) for k in kept.config}
    assert kept.note.startswith("heuristic kept: best ") and "< min gain 20.0%" in kept.note
    assert kept.runners_up[0]["config"] == best.config            # the real best, first
    assert f"heuristic {heuristic.name.split('_', 4)[-1]} (gain < min 20.0%)" in text
    assert "table entry: " + heuristic.name + "; heuristic kept" in text
    lines = []
    assert cli.tune_main(common + ["--min-gain", "-1"], log=lines.append) == 2
    assert lines == ["cuflash tune: --min-gain must be a percentage in [0, 100), got -1"]
