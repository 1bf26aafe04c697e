"""cuflash.bench without a GPU: shapes and FLOPs, records, ratio tables, CSV/JSON/plots from
synthetic records, the CLI, NoGPUError, and the fwd / fwdbwd / tuned loops on CPU tensors
(a fake GPU for selection, cuflash's NumPy reference path, the CUDA-event timer faked)."""
import csv
import json

import pytest

from cuflash import _gpu, problem, registry, timing
from cuflash.bench import common, fwd, fwdbwd, memory, tuned
from cuflash.problem import Problem
from cuflash.registry import op_flops
from cuflash.timing import Timing

torch = pytest.importorskip("torch")

try:
    import matplotlib  # noqa: F401
    HAS_MPL = True
except ImportError:
    HAS_MPL = False

QUIET = dict(log=lambda *_: None)
NO_GPU = not _gpu.available()


# ---------------------------------------------------------------------------------------
# shapes, FLOPs, records

def test_problems_follow_the_convention():
    ps = common.problems("fwd", ("bf16",), (64, 128), (False, True), common.SEQLENS)
    assert len(ps) == 2 * 2 * 6
    assert [p.seqlen_q for p in ps[:6]] == [512, 1024, 2048, 4096, 8192, 16384]
    for p in ps:
        assert p.batch * p.seqlen_q == 16384 and p.nheads * p.head_dim == 2048
        assert p.seqlen_q == p.seqlen_k and p.nheads == p.nheads_kv
    assert common.HDIMS == (64, 128, 256)
    assert memory.SEQLENS[0] == 1024 and memory.SEQLENS[-1] == 65536


def test_fields_and_tflops():
    p = Problem.fa_convention("bwd", "bf16", 128, True, 2048)
    f = common.fields(p)
    assert f == dict(op="bwd", dtype="bf16", hdim=128, causal=True, batch=8, seqlen=2048, nheads=16)
    assert common.tflops(p, 2.0) == pytest.approx(op_flops(p) / 2.0 / 1e9)
    assert op_flops(p) == pytest.approx(2.5 * 4 * 8 * 16 * 2048 * 2048 * 128 / 2)
    assert common.tflops(p, None) is None


def test_fmt_seqlen_and_median():
    assert common.fmt_seqlen(512) == "512" and common.fmt_seqlen(16384) == "16k"
    assert common.median([3, 1, 2]) == 2 and common.median([1, 2, 3, 4]) == 2.5
    assert common.median([None]) is None


def test_timed_record():
    p = Problem.fa_convention("fwd", "bf16", 64, False, 1024)
    rec = common.timed_record(p, "sdpa_flash", Timing(0.5, (0.4, 0.5, 0.6), 10, False), config="")
    assert rec["impl"] == "sdpa_flash" and rec["ms"] == 0.5 and rec["spread"] == pytest.approx(0.4)
    assert rec["tflops"] == pytest.approx(op_flops(p) / 0.5 / 1e9)
    err = common.timed_record(p, "sdpa_cudnn", "RuntimeError: no kernel")
    assert err["error"] == "RuntimeError: no kernel" and "ms" not in err


def test_short_and_is_oom():
    assert common.short(ValueError("a\nb")) == "ValueError: a"
    assert common.is_oom(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert not common.is_oom(RuntimeError("no kernel"))


def test_gpu_label_and_env_never_raise():
    assert isinstance(common.gpu_label(), str)
    env = common.env_record()
    for key in ("device", "cc", "driver", "torch", "cupy", "cuflash"):
        assert key in env


# ---------------------------------------------------------------------------------------
# synthetic records: tables, files, plots

def fake_records(with_error=True):
    """fwdbwd-like records: cuflash:fa2_bwd 4 % slower than sdpa_flash, sdpa_cudnn faster,
    sdpa_cudnn refusing d128 causal 4k."""
    recs = []
    for p in common.problems("bwd", ("bf16",), (64, 128), (False, True), (1024, 2048, 4096)):
        for impl, fwd_ms, bwd_ms in (("cuflash:fa2_bwd", 1.0, 2.6), ("sdpa_flash", 1.0, 2.5),
                                     ("sdpa_cudnn", 0.6, 1.5)):
            rec = dict(impl=impl, **common.fields(p), fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                       bwd_tflops=common.tflops(p, bwd_ms), fwdbwd_ms=fwd_ms + bwd_ms,
                       fwdbwd_tflops=3.5 / 2.5 * op_flops(p) / (fwd_ms + bwd_ms) / 1e9)
            if with_error and impl == "sdpa_cudnn" and p.head_dim == 128 and p.causal \
                    and p.seqlen_q == 4096:
                rec = {k: v for k, v in rec.items() if not k.startswith(("fwd", "bwd"))}
                rec["error"] = "RuntimeError: No available kernel"
            recs.append(rec)
    return recs


def test_ratio_table():
    lines = common.ratio_table(fake_records(), "bwd_tflops", "cuflash:fa2_bwd",
                               ("sdpa_flash", "sdpa_cudnn")).splitlines()
    assert lines[0] == "bwd_tflops of cuflash:fa2_bwd (ratio to sdpa_flash / sdpa_cudnn)"
    assert lines[2] == "| dtype | hdim | causal | 1k | 2k | 4k |"
    assert len(lines) == 4 + 4                              # 4 (hdim, causal) rows
    assert lines[4].startswith("| bf16 | 64 | no | ")      # numeric order: 64 before 128
    assert "(0.96× / 0.58×)" in lines[4]                    # 2.5 / 2.6, 1.5 / 2.6
    assert lines[-1].endswith("(0.96× / -) |")              # sdpa_cudnn refused d128 causal 4k
    missing = common.ratio_table(fake_records(), "bwd_tflops", "sdpa_cudnn")
    assert "| bf16 | 128 | yes | " in missing and " - |" in missing
    both = common.ratio_tables(fake_records(), "bwd_tflops")
    assert both.count("ratio to sdpa_flash / sdpa_cudnn") == 1


def test_line():
    p = Problem.fa_convention("bwd", "bf16", 128, True, 4096)
    recs = [r for r in fake_records() if (r["hdim"], r["causal"], r["seqlen"]) == (128, True, 4096)]
    text = common.line(p, recs, "bwd_tflops")
    assert "sdpa_cudnn=error" in text and "cuflash:fa2_bwd/sdpa_flash=0.96" in text


def test_write_json_csv_png(tmp_path):
    recs = fake_records()
    common.write(recs, tmp_path / "gpu", "bench_fwdbwd",
                 dict(metrics=("bwd_tflops", "fwdbwd_tflops"), title="test"), extra_field=1, **QUIET)
    out = tmp_path / "gpu"
    data = json.loads((out / "bench_fwdbwd.json").read_text())
    assert data["records"] == recs and data["extra_field"] == 1 and "device" in data["env"]
    assert common.read_records(out / "bench_fwdbwd.json") == recs
    with open(out / "bench_fwdbwd.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(recs)
    for key in ("impl", "dtype", "hdim", "causal", "batch", "seqlen", "fwd_ms", "bwd_ms",
                "bwd_tflops", "error"):
        assert key in rows[0]
    err = [r for r in rows if r["error"]]
    assert len(err) == 1 and err[0]["bwd_ms"] == ""
    assert (out / "bench_fwdbwd.png").exists() == HAS_MPL
    if HAS_MPL:
        assert (out / "bench_fwdbwd.png").stat().st_size > 1000


def test_write_without_plot(tmp_path):
    common.write(fake_records(), tmp_path, "x", None, **QUIET)
    assert (tmp_path / "x.json").exists() and not (tmp_path / "x.png").exists()


def fake_memory_records():
    recs = []
    for s in memory.SEQLENS:
        base = dict(dtype="bf16", hdim=128, causal=True, batch=1, nheads=16, seqlen=s)
        inputs = 4 * s * 16 * 128 * 2
        recs.append(dict(impl="cuflash:fa2_bwd", **base, peak_mib=1.5 * inputs / 2**20, oom=False))
        recs.append(dict(impl="sdpa_flash", **base, peak_mib=1.45 * inputs / 2**20, oom=False))
        if s <= 16384:
            recs.append(dict(impl="sdpa_math", **base, peak_mib=3 * 16 * s * s * 2 / 2**20, oom=False))
        else:
            recs.append(dict(impl="sdpa_math", **base, oom=True, error="OutOfMemoryError: CUDA out of memory."))
    return recs


def test_memory_tables_line_and_plot(tmp_path):
    recs = fake_memory_records()
    text = memory.tables(recs)
    assert text.startswith("peak_mib of cuflash:fa2_bwd (ratio to sdpa_flash / sdpa_math)")
    assert "(1.03× / -)" in text                           # sdpa_math out of memory at 32k+
    line = memory.line([r for r in recs if r["seqlen"] == 65536])
    assert "sdpa_math=OOM" in line and "cuflash:fa2_bwd=" in line
    if HAS_MPL:
        assert common.plot(recs, tmp_path / "memory.png", "peak_mib", logy=True)
        assert (tmp_path / "memory.png").stat().st_size > 1000
    else:
        assert not common.plot(recs, tmp_path / "memory.png", "peak_mib")


def test_tuned_tables_from_synthetic_records():
    recs = []
    for op in ("fwd", "bwd"):
        for p in common.problems(op, ("bf16",), (64,), (True,), (1024, 2048)):
            for impl, ms in (("tuned:fa2_" + op, 0.95), ("heuristic:fa2_" + op, 1.0), ("sdpa_flash", 0.9)):
                recs.append(common.timed_record(p, impl, Timing(ms, (ms,), 10, False),
                                                family="fa2_" + op if ":" in impl else None))
    text = tuned.tables(recs)
    assert "tflops of tuned:fa2_fwd (ratio to heuristic:fa2_fwd / sdpa_flash)" in text
    assert "| op | dtype | hdim | causal | 1k | 2k |" in text
    assert "(1.053× / 0.947×)" in text


# ---------------------------------------------------------------------------------------
# the loops on CPU tensors

@pytest.fixture
def fake_gpu(monkeypatch):
    """Selection sees an sm_90 GPU named 'Fake GPU' (no tuned table: heuristics); tensors
    live on the CPU (cuflash's reference path); the convention shrinks to 64 tokens and
    model dim 128; time_interleaved runs each callable once and reports 1, 2, 3 ... ms."""
    monkeypatch.setattr(_gpu, "require", lambda what: None)
    monkeypatch.setattr(_gpu, "available", lambda: True)
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (9, 0))
    monkeypatch.setattr(_gpu, "name", lambda device=0: "Fake GPU")
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: 227 * 1024)
    monkeypatch.setattr(problem, "TOTAL_TOKENS", 64)
    monkeypatch.setattr(problem, "MODEL_DIM", 128)
    monkeypatch.setattr(common, "DEVICE", "cpu")
    calls = []

    def fake_interleaved(fns, reps=20, flush_l2=False, **kw):
        calls.append(list(fns))
        for fn in fns.values():
            fn()
        return {name: Timing(1.0 + i, (1.0 + i,) * reps, 10, flush_l2) for i, name in enumerate(fns)}

    monkeypatch.setattr(timing, "time_interleaved", fake_interleaved)
    return calls


def test_fwd_loop_on_cpu(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (8, 0))  # the FA2 families only
    recs = fwd.run(hdims=(64,), seqlens=(32,), causals=(True,), out=tmp_path, reps=2, **QUIET)
    by = {r["impl"]: r for r in recs}
    assert list(by) == ["cuflash:fa2_fwd", "sdpa_flash", "sdpa_cudnn"]
    for r in recs:
        assert (r["batch"], r["seqlen"], r["nheads"], r["hdim"], r["causal"]) == (2, 32, 2, 64, True)
    c = by["cuflash:fa2_fwd"]
    assert c["family"] == "fa2_fwd" and c["config"].startswith("fwd_bf16_d64_causal")
    assert c["source"].startswith("heuristic") and c["ms"] == 1.0
    p = Problem.fa_convention("fwd", "bf16", 64, True, 32)
    assert c["tflops"] == pytest.approx(op_flops(p) / 1.0 / 1e9)
    assert "error" in by["sdpa_cudnn"]                       # no cuDNN attention on the CPU
    assert "sdpa_cudnn" not in fake_gpu[0]                  # refused on its first call: not timed
    data = json.loads((tmp_path / "Fake_GPU" / "bench_fwd.json").read_text())
    assert data["records"] == recs


def test_fwdbwd_loop_on_cpu(tmp_path, fake_gpu):
    recs = fwdbwd.run(hdims=(64,), seqlens=(32,), causals=(True,), out=tmp_path, reps=2,
                      deterministic=True, **QUIET)
    by = {r["impl"]: r for r in recs}
    # every backward family that supports the (fake, sm_90) GPU is timed, with its [det] twin
    bwd_families = [f"cuflash:{f.name}" for f in registry.families("bwd")
                    if not f.supports((9, 0), Problem.fa_convention("bwd", "bf16", 64, True, 32))]
    assert list(by) == (bwd_families + [n + "[det]" for n in bwd_families] + ["sdpa_flash", "sdpa_cudnn"])
    assert "cuflash:fa2_bwd" in bwd_families
    c, det = by["cuflash:fa2_bwd"], by["cuflash:fa2_bwd[det]"]
    assert det["config"].endswith("_det") and not c["config"].endswith("_det")
    assert "bf16_d64_causal" in c["fwd_config"]  # the forward family chosen for this GPU
    pb = Problem.fa_convention("bwd", "bf16", 64, True, 32)
    assert c["bwd_tflops"] == pytest.approx(op_flops(pb) / c["bwd_ms"] / 1e9)
    assert c["fwdbwd_ms"] == c["fwd_ms"] + c["bwd_ms"]
    assert c["fwdbwd_tflops"] == pytest.approx(3.5 / 2.5 * op_flops(pb) / c["fwdbwd_ms"] / 1e9)
    assert "error" in by["sdpa_cudnn"] and by["sdpa_cudnn"]["bwd_ms"] is None
    if "error" not in by["sdpa_flash"]:                     # CPU SDPA flash: a sanity number
        assert c["grad_rel_diff_vs_sdpa_flash"] < 0.05 and det["grad_rel_diff_vs_sdpa_flash"] < 0.05
    assert (tmp_path / "Fake_GPU" / "bench_fwdbwd.csv").exists()


def test_tuned_loop_on_cpu(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (8, 0))  # the FA2 families only
    real = common.heuristic_config

    def heuristic(fam, p, device=0):      # the forward's heuristic differs from its "tuned" config
        cfg = real(fam, p, device)
        return cfg.replace(Bc=32 if cfg.Bc != 32 else 64) if fam.op == "fwd" else cfg

    monkeypatch.setattr(tuned, "heuristic_config", heuristic)
    recs = tuned.run(hdims=(64,), seqlens=(32,), causals=(True,), out=tmp_path, reps=2, **QUIET)
    cells = {(r["op"], r["impl"]): r for r in recs}
    assert [k for k in cells] == [("fwd", "tuned:fa2_fwd"), ("fwd", "heuristic:fa2_fwd"),
                                  ("fwd", "sdpa_flash"), ("fwd", "sdpa_cudnn"),
                                  ("bwd", "tuned:fa2_bwd"), ("bwd", "heuristic:fa2_bwd"),
                                  ("bwd", "sdpa_flash"), ("bwd", "sdpa_cudnn")]
    t, h = cells[("fwd", "tuned:fa2_fwd")], cells[("fwd", "heuristic:fa2_fwd")]
    assert t["same_config"] is False and t["config"] != h["config"] and t["ms"] != h["ms"]
    assert fake_gpu[0][:2] == ["tuned:fa2_fwd", "heuristic:fa2_fwd"]     # timed interleaved
    t, h = cells[("bwd", "tuned:fa2_bwd")], cells[("bwd", "heuristic:fa2_bwd")]
    assert t["same_config"] is True and t["ms"] == h["ms"] and h["source"] == "heuristic"
    assert "heuristic:fa2_bwd" not in fake_gpu[1]                         # one kernel: timed once
    assert (tmp_path / "Fake_GPU" / "bench_tuned.json").exists()


def test_measure_skips_what_fails(fake_gpu):
    def boom():
        raise RuntimeError("no kernel")

    out = common.measure({"a": lambda: None, "b": boom, "c": lambda: None}, reps=3, **QUIET)
    assert list(out) == ["a", "b", "c"]
    assert out["b"] == "RuntimeError: no kernel" and out["a"].median_ms == 1.0 and out["c"].median_ms == 2.0
    assert fake_gpu == [["a", "c"]]


# ---------------------------------------------------------------------------------------
# the CLI

def test_parser_and_modes():
    from cuflash import bench

    a = bench.parser().parse_args(["--mode", "fwd", "io", "--hdims", "64", "--dtypes", "bf16", "fp16",
                                   "--io-causal", "--no-ncu", "--flush-l2"])
    assert a.mode == ["fwd", "io"] and a.hdims == [64] and a.dtypes == ["bf16", "fp16"]
    assert a.io_causal and a.no_ncu and a.flush_l2 and a.calls == 2000 and a.repeats == 3
    assert bench.modes_of(["all"]) == ["fwd", "fwdbwd", "memory", "overhead", "startup"]
    assert bench.modes_of(["io", "fwd", "tuned"]) == ["fwd", "tuned", "io"]
    assert bench.parser().parse_args([]).mode == ["fwd"]
    with pytest.raises(SystemExit):
        bench.main(["--mode", "nonsense"])


def test_help_lists_the_modes(capsys):
    from cuflash import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for mode in bench.MODES + ("all",):
        assert mode in out
    assert "--io-seqlens" in out and "--calls" in out and "--repeats" in out


@pytest.mark.skipif(not NO_GPU, reason="a GPU is usable: the modes would run")
@pytest.mark.parametrize("mode", ["fwd", "fwdbwd", "memory", "tuned", "overhead", "startup", "io", "all"])
def test_every_mode_raises_no_gpu_error(mode, tmp_path):
    from cuflash import bench

    with pytest.raises(_gpu.NoGPUError):
        bench.main(["--mode", mode, "--hdims", "64", "--seqlens", "512", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())                       # nothing written
