"""python -m cuflash tune / info (tuning/cli.py) without a GPU, and the tune loop with the
GPU parts replaced by the deterministic fake. CPU only."""
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _gpu, registry, select
from cuflash.families.base import MAX_SMEM_BY_ARCH
from cuflash.problem import Problem
from cuflash.select import Entry, TunedTableWarning
from cuflash.tuning import cli
from cuflash.tuning.table import save_entries

REPO = Path(__file__).resolve().parent.parent
H100_SMEM = MAX_SMEM_BY_ARCH[(9, 0)]
A100_SMEM = MAX_SMEM_BY_ARCH[(8, 0)]
FWD, BWD = registry.get("fa2_fwd"), registry.get("fa2_bwd")
needs_no_gpu = pytest.mark.skipif(_gpu.available(), reason="a GPU is usable here")


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(select.ENV_VAR, str(tmp_path / "user"))
    monkeypatch.setattr(select, "shipped_dir", lambda: tmp_path / "shipped")
    select.clear_cache()
    yield tmp_path / "user", tmp_path / "shipped"
    select.clear_cache()


def test_parser_reads_lists():
    a = cli.tune_parser().parse_args(["--dtype", "bf16", "--hdim", "64,128", "--seqlen",
                                      "512,3000", "--causal", "true", "--brute-force",
                                      "--op", "fwd,bwd", "--family", "fa2_bwd"])
    assert (a.dtype, a.hdim, a.seqlen, a.causal, a.brute_force, a.op, a.family) == \
        (["bf16"], [64, 128], [512, 3000], "true", True, ["fwd", "bwd"], ["fa2_bwd"])
    d = cli.tune_parser().parse_args([])
    assert d.min_gain == 1.0 and d.op == ["all"] and d.family is None     # percent; every family
    assert cli.tune_parser().parse_args(["--min-gain", "2.5"]).min_gain == 2.5
    text = cli.tune_parser().format_help()
    assert "--min-gain" in text and "--family" in text and "--op" in text


@needs_no_gpu
def test_tune_without_gpu_fails_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cuflash", "tune", "--op", "fwd"],
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
    assert out.startswith("cuflash ") and "fa2_fwd v1 code " in out and "fa2_bwd" in out
    assert "tuned tables (searched in this order" in out and "GPU: none (" in out


def test_info_families_needs_no_gpu(monkeypatch, capsys):
    def no_cuda(*a, **k):
        raise AssertionError("info --families made a CUDA call")

    for name in ("why_unavailable", "name", "arch", "max_smem", "sm_count"):
        monkeypatch.setattr(_gpu, name, no_cuda)
    lines = cli.info_families_lines()
    text = "\n".join(lines)
    for fam in registry.families():
        (line,) = [ln for ln in lines if ln.strip().startswith(fam.name + ":")]
        from cuflash.compile import code_hash

        assert f"op {fam.op}" in line and f"sm_{fam.min_arch[0]}{fam.min_arch[1]}" in line
        assert f"version {fam.version}" in line and f"code {code_hash(fam.name)}" in line
        n = 1
        for values in fam.space.values():
            n *= len(values)
        assert f"space {n} points" in line
        assert fam.description in text
    assert "op fwd" in text and "op bwd" in text
    from cuflash.__main__ import main

    assert main(["info", "--families"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def fresh(family, head_dim=128, causal=True, seqlen=4096, dtype="bf16", **cfg):
    return Entry(family.op, family.name, dtype, head_dim, causal, seqlen, cfg,
                 stamp=select.current_stamp(family), median_ms=1.0, tflops=300.0)


def fake_gpu(monkeypatch, arch=(9, 0)):
    """A GPU named "Fake GPU" of compute capability ``arch``, with that arch's shared memory.
    On sm_90 the forward is sm90_fwd's; tests of fa2_fwd's tables take an sm_80 one."""
    monkeypatch.setattr(_gpu, "why_unavailable", lambda: "")
    monkeypatch.setattr(_gpu, "name", lambda device=0: "Fake GPU")
    monkeypatch.setattr(_gpu, "arch", lambda device=0: tuple(arch))
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: MAX_SMEM_BY_ARCH[tuple(arch)])


def test_info_lists_tables_and_the_config_in_force(monkeypatch, dirs):
    user, shipped = dirs
    e = fresh(FWD, Br=128, Bc=64, warps=4, stages=3)
    stale = Entry("bwd", "fa2_bwd", "bf16", 64, False, 512,
                  {"Br": 32, "Bc": 128, "warps": 4, "stages": 2, "dsplit": 1, "qsplit": 1},
                  stamp={"version": 1, "code_hash": "retired-x"})
    path = save_entries([e, stale], "Fake GPU", (8, 0))
    save_entries([e], "Other GPU", (8, 0))
    shipped.mkdir()
    (shipped / select.file_name("Fake GPU", (8, 0))).write_text("[[[")
    fake_gpu(monkeypatch, (8, 0))
    with pytest.warns(TunedTableWarning) as w:
        lines = cli.info_lines()
    messages = " | ".join(str(x.message) for x in w)
    assert "ignoring tuned table" in messages and "has stale entries" in messages
    text = "\n".join(lines)
    assert "GPU: Fake GPU, sm_80" in text
    assert (f"{path.name}: Fake GPU sm_80, 2 entries (fa2_bwd, fa2_fwd), 1 stale (other code: "
            "ignored until re-tuned) <- this GPU") in text
    assert "Other_GPU_sm80.yaml: Other GPU sm_80, 1 entries (fa2_fwd)\n" in text + "\n"
    assert "Fake_GPU_sm80.yaml: unusable" in text
    tuned = [ln for ln in lines if "fwd fa2_fwd bf16 d=128 causal=True " in ln]
    assert len(tuned) == 6 and all("Br128_Bc64_w4_s3" in ln and "tuned" in ln for ln in tuned)
    assert any("fwd fa2_fwd fp16 d=64" in ln and "<- heuristic" in ln for ln in lines)
    (bwd64,) = [ln for ln in lines if "bwd fa2_bwd bf16 d=64  causal=False" in ln]
    assert "<- heuristic (" in bwd64 and "stale skipped" in bwd64


def test_config_in_force_on_sm90_is_sm90_fwd_and_the_ranked_bwd(dirs):
    user, _ = dirs
    save_entries([fresh(FWD, Br=128, Bc=64, warps=4, stages=3)], "Fake GPU", (9, 0))
    lines = cli.config_in_force_lines("Fake GPU", (9, 0), H100_SMEM, dirs=[user], head_dims=(64, 128))
    fwd = [ln for ln in lines if ln.startswith("  fwd ")]
    bwd = [ln for ln in lines if ln.startswith("  bwd ")]
    assert len(fwd) == len(bwd) == 8            # 2 dtypes x 2 head dims x causal or not
    assert all(ln.startswith("  fwd sm90_fwd ") and "<- heuristic" in ln for ln in fwd), fwd
    # sm90_bwd ranks first at every head dim up to 128 (d64: its two-consumer BM128 tile)
    assert all(ln.startswith("  bwd sm90_bwd ") and "<- heuristic" in ln for ln in bwd), bwd


def test_config_in_force_says_unsupported(monkeypatch):
    lines = cli.config_in_force_lines("Fake GPU", (7, 5), 64 * 1024, head_dims=(64,))
    assert lines and all("unsupported here" in ln and "needs sm_80" in ln for ln in lines)


def fake_tuning(monkeypatch, arch=(9, 0)):
    from cuflash.tuning import fake, measure

    fake_gpu(monkeypatch, arch)
    made = []

    def fake_measure(fam, p, device, **kw):
        made.append((fam, p))
        return fake.FakeMeasure()

    monkeypatch.setattr(measure, "GpuMeasure", fake_measure)
    monkeypatch.setattr(measure, "env_record", lambda fam, device=0: {
        "family": fam.name, "family_version": fam.version,
        "code_hash": select.current_stamp(fam)["code_hash"], "gpu": "Fake GPU",
        "cc": select.cc_str(arch)})
    return made


def test_tune_loop_with_a_fake_gpu(monkeypatch, tmp_path):
    pytest.importorskip("optuna")
    made = fake_tuning(monkeypatch, (8, 0))       # sm_80: fa2_fwd is the forward chosen there
    lines = []
    args = ["--op", "fwd", "--family", "fa2_fwd", "--dtype", "bf16", "--hdim", "128",
            "--seqlen", "512,16384", "--causal", "false", "--trials", "8", "--seed", "0", "--no-progress", "--no-plots",
            "--no-precompile", "--out", str(tmp_path / "res"), "--table-dir", str(tmp_path / "ship")]
    assert cli.tune_main(args, log=lines.append) == 0
    text = "\n".join(lines)
    assert "[2/2] fwd_fa2_fwd_bf16_d128_full_s16384_Fake_GPU_v1_" in text and "vs heuristic" in text
    assert [(f, p) for f, p in made] == [(FWD, Problem.fa_convention("fwd", "bf16", 128, False, s))
                                         for s in (512, 16384)]
    tf = select.read_file(tmp_path / "ship" / "Fake_GPU_sm80.yaml")
    assert sorted(e.seqlen for e in tf.entries) == [512, 16384]
    assert all(e.stamp == select.current_stamp(FWD) and e.family == "fa2_fwd" for e in tf.entries)
    assert len(list((tmp_path / "res" / "Fake_GPU" / "tuning").glob("*.json"))) == 2
    assert (tmp_path / "res" / "Fake_GPU" / "tuning" / "studies.journal").exists()
    fam, cfg, source = select.choose(Problem("fwd", "bf16", 1, 16384, 16384, 1, 1, 128, False),
                                     (8, 0), "Fake GPU", A100_SMEM, dirs=[tmp_path / "ship"])
    assert fam is FWD and source.startswith("tuned") and cfg.Br == 128
    # re-running resumes: nothing new is measured, the same table comes out
    lines.clear()
    assert cli.tune_main(args, log=lines.append) == 0
    text = "\n".join(lines)
    assert text.count("configs already measured, 0 queued again)") == 2
    assert select.read_file(tmp_path / "ship" / "Fake_GPU_sm80.yaml").entries == tf.entries


def test_tune_every_family_of_every_op_by_default(monkeypatch, tmp_path):
    pytest.importorskip("optuna")
    from cuflash.families import sm90_bwd, sm90_fwd

    # dq_first (sm90_bwd's heuristic at d 64 up to 2k keys) is outside the tuning space: such a
    # class gets no table entry (the heuristic serves it); this test wants one entry per family
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DQ_FIRST", frozenset())
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_WIDE_EPI", frozenset())   # (wide_epi likewise, session 20)
    monkeypatch.setattr(sm90_fwd, "SHORT_CAUSAL_FIELDS", {})   # (q_double / tma_store at d64 causal 1k, session 31)
    made = fake_tuning(monkeypatch)
    lines = []
    args = ["--dtype", "fp16", "--hdim", "64,12", "--seqlen", "1000", "--causal", "true",
            "--trials", "3", "--seed", "0", "--no-progress", "--no-plots", "--no-precompile",
            "--out", str(tmp_path / "res"), "--table-dir", str(tmp_path / "t")]
    assert cli.tune_main(args, log=lines.append) == 0
    # every family but those that only run problems with a feature (fa2_fwd_paged: block_table)
    tunable = lambda op: [f for f in registry.families(op, "fp16") if not getattr(f, "requires", ())]  # noqa: E731
    assert [f for f, _ in made] == tunable("fwd") + tunable("bwd") + tunable("decode")
    tf = select.read_file(tmp_path / "t" / "Fake_GPU_sm90.yaml")
    want = sorted((f.op, f.name, "fp16", 64, True, (), 1024) for f in registry.families()
                  if not f.supports((9, 0), Problem.fa_convention(f.op, "fp16", 64, True, 1024)))
    assert "fa2_fwd" in {k[1] for k in want} and "fa2_bwd" in {k[1] for k in want}
    assert sorted(e.key for e in tf.entries) == want
    text = "\n".join(lines)
    assert "skipped 1 fa2_fwd studies: q: headdim must be a multiple of 8" in text
    assert "skipped 1 fa2_bwd studies" in text
    # --family picks one family (of any op, --op all being the default)
    made.clear()
    assert cli.tune_main(args + ["--family", "fa2_bwd"], log=lines.append) == 0
    assert [f for f, _ in made] == [BWD]


def test_tune_refuses_bad_input(monkeypatch):
    pytest.importorskip("optuna")
    fake_gpu(monkeypatch)
    for argv, why in (
            (["--dtype", "fp32"], "--dtype must be among bf16, fp16, e4m3, got ['fp32']"),
            (["--op", "sideways"], f"--op must be {', '.join(registry.OPS)} or all, got 'sideways'"),
            (["--family", "nope"], "--family: unknown kernel family 'nope'; registered: "
                                   f"{sorted(f.name for f in registry.families())}"),
            (["--op", "fwd", "--family", "fa2_bwd"],
             "--family: family fa2_bwd implements op 'bwd', not fwd (asked for --op fwd)"),
            (["--hdim", "12", "--no-precompile"],
             "nothing to tune: no requested family supports the requested problems on Fake GPU (sm_90)"),
    ):
        lines = []
        assert cli.tune_main(argv, log=lines.append) == 2
        assert lines[-1] == "cuflash tune: " + why


def test_tune_min_gain_keeps_the_heuristic(monkeypatch, tmp_path):
    """The fake's best is ~5% faster than the heuristic: --min-gain 1 (default) writes the
    best, --min-gain 20 keeps the heuristic and says so; the best still shows in the log."""
    pytest.importorskip("optuna")
    fake_tuning(monkeypatch)
    p = Problem.fa_convention("fwd", "bf16", 128, False, 4096)
    heuristic = FWD.heuristic(p, (9, 0), H100_SMEM)
    common = ["--op", "fwd", "--family", "fa2_fwd", "--dtype", "bf16", "--hdim", "128", "--seqlen", "4096",
              "--causal", "false", "--brute-force", "--no-progress", "--no-plots", "--no-precompile"]
    entries = {}
    for gain in ("1", "20"):
        lines = []
        args = common + ["--min-gain", gain, "--out", str(tmp_path / f"res{gain}"),
                         "--table-dir", str(tmp_path / f"t{gain}")]
        assert cli.tune_main(args, log=lines.append) == 0
        (e,) = select.read_file(tmp_path / f"t{gain}" / "Fake_GPU_sm90.yaml").entries
        entries[gain] = (e, "\n".join(lines))
    best, text = entries["1"]
    assert best.config != FWD.point(heuristic) and best.note == ""
    kept, text = entries["20"]
    assert kept.config == FWD.point(heuristic)
    assert kept.note.startswith("heuristic kept: best ") and "< min gain 20.0%" in kept.note
    assert kept.runners_up[0]["config"] == best.config            # the real best, first
    assert f"heuristic {heuristic.name.split('_', 4)[-1]} (gain < min 20.0%)" in text
    assert "table entry: " + heuristic.name + "; heuristic kept" in text
    lines = []
    assert cli.tune_main(common + ["--min-gain", "-1"], log=lines.append) == 2
    assert lines == ["cuflash tune: --min-gain must be a percentage in [0, 100), got -1"]


def test_precompile_covers_every_valid_config_of_every_study(monkeypatch, tmp_path):
    pytest.importorskip("optuna")
    fake_tuning(monkeypatch)
    from cuflash import compile as cucompile

    seen = []

    def fake_precompile(configs, device_id=0, processes=None, progress=None):
        configs = list(configs)
        seen.extend(configs)
        for i, c in enumerate(configs, start=1):
            progress(i, len(configs), (c, 0.0, ""))
        return [(c, 0.0, "") for c in configs]

    monkeypatch.setattr(cucompile, "precompile", fake_precompile)
    lines = []
    args = ["--family", "fa2_fwd,fa2_bwd", "--dtype", "bf16", "--hdim", "64", "--seqlen",
            "512,4096", "--causal", "false", "--trials", "2", "--no-plots", "--out", str(tmp_path / "r"), "--table-dir", str(tmp_path / "t")]
    assert cli.tune_main(args, log=lines.append) == 0
    want = {c for fam in (FWD, BWD)
            for c in fam.valid(Problem.fa_convention(fam.op, "bf16", 64, False, 512), H100_SMEM)}
    assert len(seen) == len(set(seen)) and set(seen) == want   # buckets share configs
    assert f"precompiled {len(want)} configs" in "\n".join(lines)
    assert any(ln.startswith(f"  precompiled {len(want)}/{len(want)}") for ln in lines)


def test_info_families_says_which_families_rank_per_problem():
    """sm90_bwd's priority (1) is not its selection order (Family.rank: below fa2_bwd at head
    dims <= 64): info --families says it ranks per problem; the others rank by priority."""
    lines = cli.info_families_lines()
    assert "Family.rank" in lines[0]
    by_name = {ln.split(":")[0].strip(): ln for ln in lines if ln.startswith("    ") and ": op " in ln}
    assert "ranked per problem" in by_name["sm90_bwd"]
    assert "ranked per problem" not in by_name["fa2_bwd"] and "ranked per problem" not in by_name["fa2_fwd"]


def test_supported_features_probe_with_a_familys_required_features():
    """fa2_fwd_paged runs only paged varlen calls: its features are probed with those on."""
    from cuflash import registry

    paged = cli.supported_features(registry.get("fa2_fwd_paged"))
    assert {"paged", "varlen", "window", "softcap", "alibi"} <= set(paged) and "dropout" not in paged
    assert "varlen" in cli.supported_features(registry.get("fa2_fwd"))


def test_tune_e4m3_with_a_fake_gpu(monkeypatch, tmp_path):
    """--dtype e4m3 runs the FP8 forward family's studies only (the bf16/fp16 families are
    skipped by their dtypes), writes e4m3 entries that selection and info then show."""
    pytest.importorskip("optuna")
    made = fake_tuning(monkeypatch)
    fp8 = registry.get("sm90_fwd_fp8")
    lines = []
    args = ["--op", "fwd", "--dtype", "e4m3", "--hdim", "128,256", "--seqlen", "16384",
            "--causal", "false", "--trials", "4", "--seed", "0", "--no-progress", "--no-plots",
            "--no-precompile", "--out", str(tmp_path / "res"), "--table-dir", str(tmp_path / "t")]
    assert cli.tune_main(args, log=lines.append) == 0
    assert [(f, p) for f, p in made] == [(fp8, Problem.fa_convention("fwd", "e4m3", d, False, 16384))
                                         for d in (128, 256)]
    text = "\n".join(lines)
    assert "skipped 2 fa2_fwd studies: fa2_fwd runs dtypes bf16, fp16, not e4m3" in text
    assert "fwd_sm90_fwd_fp8_e4m3_d256_full_s16384" in text
    tf = select.read_file(tmp_path / "t" / "Fake_GPU_sm90.yaml")
    assert sorted(e.key for e in tf.entries) == [("fwd", "sm90_fwd_fp8", "e4m3", d, False, (), 16384)
                                                 for d in (128, 256)]
    assert all(e.stamp == select.current_stamp(fp8) for e in tf.entries)
    p = Problem("fwd", "e4m3", 1, 16384, 16384, 8, 8, 256, False)
    fam, cfg, source = select.choose(p, (9, 0), "Fake GPU", H100_SMEM, dirs=[tmp_path / "t"])
    assert fam is fp8 and source.startswith("tuned")
    monkeypatch.setenv(select.ENV_VAR, str(tmp_path / "t"))
    select.clear_cache()
    info = cli.info_lines()
    e4m3 = [ln for ln in info if ln.startswith("  fwd sm90_fwd_fp8 e4m3 d=256 causal=False")]
    assert any("s=16384" in ln and "<- tuned" in ln for ln in e4m3), e4m3
    assert not any(ln.startswith("  bwd") and " e4m3 " in ln for ln in info)   # no e4m3 bwd family


def test_e4m3_runner():
    from cuflash.tuning import measure

    assert isinstance(measure.runner_for("fwd", "e4m3"), measure.Fp8FwdRunner)
    assert isinstance(measure.runner_for("fwd", "bf16"), measure.FwdRunner)
    assert isinstance(measure.runner_for("bwd"), measure.BwdRunner)
    with pytest.raises(LookupError, match="no runner for op 'bwd' in dtype 'e4m3'"):
        measure.runner_for("bwd", "e4m3")
