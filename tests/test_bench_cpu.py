"""The benchmark's and the training check's pure parts, without a GPU: FLOP counts, the
shape list, record writing (JSON, CSV, plots from fake records), the ratio and bar
summaries, the training task's data, the loss-curve comparison, and a tiny CPU training run."""
import csv
import json
import math

import pytest

from cuflash import bench

torch = pytest.importorskip("torch")
from cuflash import train_check  # noqa: E402 - needs torch

HAS_MPL = True
try:
    import matplotlib  # noqa: F401
except ImportError:
    HAS_MPL = False


# ---------------------------------------------------------------------------------------
# FLOPs and shapes

def test_flops_convention():
    # 4 * b * h * s^2 * d, halved under causal; backward 2.5x, fwd+bwd 3.5x
    assert bench.flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.flops(2, 16, 1024, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    f = bench.flops(1, 16, 4096, 4096, 64, True)
    assert bench.flops(1, 16, 4096, 4096, 64, True, "bwd") == pytest.approx(2.5 * f)
    assert bench.flops(1, 16, 4096, 4096, 64, True, "fwd_bwd") == pytest.approx(3.5 * f)
    assert bench.flops(1, 1, 3, 5, 8, False) == 4 * 3 * 5 * 8   # s_q != s_k


def test_shapes_follow_the_convention():
    shp = bench.shapes((64, 128), bench.SEQLENS)
    assert len(shp) == 2 * 6
    assert [s["seqlen"] for s in shp[:6]] == [512, 1024, 2048, 4096, 8192, 16384]
    for s in shp:
        assert s["batch"] * s["seqlen"] == 16384
        assert s["nheads"] * s["hdim"] == 2048
    assert bench.shapes((128,), (32768,))[0]["batch"] == 1     # never below batch 1
    assert bench.MEM_SEQLENS[0] == 1024 and bench.MEM_SEQLENS[-1] == 65536


def test_fmt_seqlen():
    assert bench._fmt_seqlen(512) == "512"
    assert bench._fmt_seqlen(16384) == "16k"


# ---------------------------------------------------------------------------------------
# fake records

def fake_fwdbwd_records(with_error=True):
    recs = []
    for hdim in (64, 128):
        for causal in (False, True):
            for shp in bench.shapes((hdim,), (1024, 2048, 4096)):
                f = bench.flops(shp["batch"], shp["nheads"], shp["seqlen"], shp["seqlen"], hdim, causal)
                for impl, fwd_ms, bwd_ms in (("cuflash", 1.0, 2.6), ("sdpa_flash", 1.0, 2.5),
                                             ("sdpa_cudnn", 0.6, 1.5)):
                    rec = dict(impl=impl, dtype="bf16", hdim=hdim, causal=causal, batch=shp["batch"],
                               seqlen=shp["seqlen"], nheads=shp["nheads"], config="",
                               fwd_ms=fwd_ms, fwd_tflops=f / fwd_ms / 1e9,
                               bwd_ms=bwd_ms, bwd_tflops=2.5 * f / bwd_ms / 1e9,
                               fwdbwd_tflops=3.5 * f / (fwd_ms + bwd_ms) / 1e9)
                    if with_error and impl == "sdpa_cudnn" and hdim == 128 and causal and shp["seqlen"] == 4096:
                        rec = {k: v for k, v in rec.items() if not k.startswith(("fwd", "bwd"))}
                        rec["error"] = "RuntimeError: No available kernel"
                    recs.append(rec)
    return recs


def test_write_json_csv_png(tmp_path):
    recs = fake_fwdbwd_records()
    bench.write(recs, tmp_path / "gpu", "bench_fwdbwd", ("bwd_tflops", "fwdbwd_tflops"),
                log=lambda *_: None, title="test")
    out = tmp_path / "gpu"
    assert json.loads((out / "bench_fwdbwd.json").read_text()) == recs
    with open(out / "bench_fwdbwd.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(recs)
    for key in ("impl", "dtype", "hdim", "causal", "batch", "seqlen", "fwd_ms", "fwd_tflops",
                "bwd_ms", "bwd_tflops", "error"):
        assert key in rows[0]
    err = [r for r in rows if r["error"]]
    assert len(err) == 1 and err[0]["bwd_ms"] == ""
    if HAS_MPL:
        assert (out / "bench_fwdbwd.png").stat().st_size > 1000


def test_forward_records_still_plot(tmp_path):
    # the forward benchmark's records (no bwd fields) and its single metric
    recs = [{k: v for k, v in r.items() if not k.startswith(("bwd", "fwdbwd"))}
            for r in fake_fwdbwd_records(with_error=False)]
    bench.write(recs, tmp_path, "bench_fwd", "fwd_tflops", log=lambda *_: None)
    assert len(json.loads((tmp_path / "bench_fwd.json").read_text())) == len(recs)
    if HAS_MPL:
        assert (tmp_path / "bench_fwd.png").exists()


def test_ratio_table():
    txt = bench.ratio_table(fake_fwdbwd_records(), "bwd_tflops")
    lines = txt.splitlines()
    assert lines[0] == "bwd_tflops of cuflash (ratio to sdpa_flash)"
    assert lines[2] == "| dtype | d | causal | 1k | 2k | 4k |"
    assert len(lines) == 4 + 4                                # header + 4 (hdim, causal) rows
    assert lines[4].startswith("| bf16 | 64 | no | ")
    assert "(0.96×)" in lines[4]                              # 2.5 / 2.6
    missing = bench.ratio_table(fake_fwdbwd_records(), "bwd_tflops", impl="sdpa_cudnn")
    assert "| bf16 | 128 | yes | " in missing and " - |" in missing   # the error record


def test_bar_summary():
    recs = fake_fwdbwd_records()
    txt = bench.bar_summary(recs)
    assert txt.startswith("backward bar (cuflash >= 0.9x sdpa_flash, seqlen >= 2048): PASS")
    assert "worst 0.96x" in txt
    slow = [dict(r, bwd_tflops=r["bwd_tflops"] * 0.5) if r["impl"] == "cuflash" and r["seqlen"] == 4096
            else r for r in recs]
    assert ": FAIL" in bench.bar_summary(slow)
    assert "no cuflash" in bench.bar_summary([r for r in recs if r["impl"] != "cuflash"])


def test_fwdbwd_line_with_error():
    recs = [r for r in fake_fwdbwd_records() if r["hdim"] == 128 and r["causal"] and r["seqlen"] == 4096]
    line = bench.fwdbwd_line(recs)
    assert "sdpa_cudnn=error" in line and "bwd cuflash/flash=0.96" in line


def fake_memory_records():
    recs = []
    for s in bench.MEM_SEQLENS:
        base = dict(dtype="bf16", hdim=128, causal=True, batch=1, nheads=16, seqlen=s)
        inputs = 4 * s * 16 * 128 * 2
        recs.append(dict(impl="cuflash", **base, peak_bytes=int(1.5 * inputs), inputs_bytes=inputs, oom=False))
        recs.append(dict(impl="sdpa_flash", **base, peak_bytes=int(1.45 * inputs), inputs_bytes=inputs, oom=False))
        if s <= 16384:
            recs.append(dict(impl="sdpa_math", **base, peak_bytes=3 * 16 * s * s * 2, inputs_bytes=inputs, oom=False))
        else:
            recs.append(dict(impl="sdpa_math", **base, inputs_bytes=inputs, oom=True,
                             error="OutOfMemoryError: CUDA out of memory."))
    return recs


def test_memory_plot_and_summaries(tmp_path):
    recs = fake_memory_records()
    if HAS_MPL:
        bench.plot_memory(recs, tmp_path / "memory.png", total_bytes=80 * 2**30, title="t")
        assert (tmp_path / "memory.png").stat().st_size > 1000
    line = bench.memory_line([r for r in recs if r["seqlen"] == 65536])
    assert "sdpa_math=OOM" in line and "cuflash/flash=1.03" in line
    assert bench.memory_bar_summary(recs).startswith("memory bar (cuflash <= 1.1x sdpa_flash): PASS")
    big = [dict(r, peak_bytes=r["peak_bytes"] * 2) if r["impl"] == "cuflash" else r for r in recs]
    assert ": FAIL" in bench.memory_bar_summary(big)


def test_fwdbwd_loop_on_cpu(tmp_path, monkeypatch):
    """run_fwdbwd's loop (impls, records, errors, grad check, output) on CPU tensors, with
    the CUDA-event timer replaced; cuflash runs its CPU (NumPy reference) path."""
    calls = []

    def fake_time_ms(fn, warmup=3, reps=20, inner=10):
        fn()
        calls.append(reps)
        return 1.0

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    recs = bench.run_fwdbwd(hdims=(64,), seqlens=(32,), causals=(True,), reps=4,
                            impls=("cuflash", "sdpa_flash", "sdpa_math", "sdpa_cudnn"),
                            out_dir=tmp_path, log=lambda *_: None, device="cpu", total_tokens=64)
    by = {r["impl"]: r for r in recs}
    assert list(by) == ["cuflash", "sdpa_flash", "sdpa_math", "sdpa_cudnn"]
    for r in recs:
        assert (r["batch"], r["seqlen"], r["nheads"], r["hdim"], r["causal"]) == (2, 32, 32, 64, True)
    assert "error" in by["sdpa_cudnn"]                    # no cuDNN attention on the CPU
    assert by["sdpa_math"]["bwd_ms"] == 1.0
    f = bench.flops(2, 32, 32, 32, 64, True)
    assert by["sdpa_math"]["bwd_tflops"] == pytest.approx(2.5 * f / 1e9)
    assert by["sdpa_math"]["fwdbwd_tflops"] == pytest.approx(3.5 * f / 2 / 1e9)
    if "error" not in by["cuflash"]:                      # cuflash's CPU path has landed
        ref = "sdpa_flash" if "error" not in by["sdpa_flash"] else None
        if ref:
            assert by["cuflash"]["grad_rel_diff_vs_sdpa_flash"] < 0.05
            assert by["sdpa_math"]["grad_rel_diff_vs_sdpa_flash"] < 0.05
        assert "bwd_autograd_ms" in by["cuflash"], by["cuflash"]
    assert json.loads((tmp_path / "cpu" / "bench_fwdbwd.json").read_text()) == recs


def test_gpu_label_never_raises():
    assert isinstance(bench.gpu_label(), str)


def test_main_parses_modes_without_gpu():
    from cuflash import _gpu

    if _gpu.available():
        pytest.skip("a GPU is usable: main would run the benchmark")
    with pytest.raises(_gpu.NoGPUError):
        bench.main(["--mode", "fwdbwd", "--hdims", "64", "--seqlens", "512"])
    with pytest.raises(SystemExit):
        bench.main(["--mode", "nonsense"])


# ---------------------------------------------------------------------------------------
# --mode tuned: tuned configs vs the heuristic defaults vs SDPA

def fake_tuned_records():
    """fwd and bwd, d 64 and 128, causal both, s 1k..4k. Tuned is the heuristic's config
    at d=64, 5 % faster at d=128, but 0.5 % slower at bwd d=128 causal s=4096; sdpa_cudnn
    refuses fwd d=128 full s=2048."""
    recs = []
    for kernel in ("fwd", "bwd"):
        for hdim in (64, 128):
            for causal in (False, True):
                for shp in bench.shapes((hdim,), (1024, 2048, 4096)):
                    s = shp["seqlen"]
                    f = bench.flops(shp["batch"], shp["nheads"], s, s, hdim, causal, kernel)
                    base = dict(kernel=kernel, dtype="bf16", hdim=hdim, causal=causal,
                                batch=shp["batch"], seqlen=s, nheads=shp["nheads"])
                    same = hdim == 64
                    heur_ms = 1.0
                    tuned_ms = heur_ms if same else heur_ms / 1.05
                    if kernel == "bwd" and hdim == 128 and causal and s == 4096:
                        tuned_ms = heur_ms * 1.005
                    for impl, ms, cfg in (("cuflash_tuned", tuned_ms, "T" if not same else "H"),
                                          ("cuflash_heuristic", heur_ms, "H"),
                                          ("sdpa_flash", 0.9, ""), ("sdpa_cudnn", 0.8, "")):
                        rec = dict(impl=impl, **base, config=cfg,
                                   source="tuned x.yaml" if cfg == "T" else ("heuristic" if cfg else ""),
                                   same_config=same if cfg else None, ms=ms, tflops=f / ms / 1e9)
                        if impl == "sdpa_cudnn" and kernel == "fwd" and hdim == 128 and not causal \
                                and s == 2048:
                            rec = {k: v for k, v in rec.items() if k not in ("ms", "tflops")}
                            rec["error"] = "RuntimeError: No available kernel"
                        recs.append(rec)
    return recs


def test_tuned_table_and_verdict():
    recs = fake_tuned_records()
    lines = bench.tuned_table(recs).splitlines()
    assert lines[2] == "| kernel | dtype | d | causal | 1k | 2k | 4k |"
    assert len(lines) == 4 + 8                       # 2 kernels x 2 hdims x 2 causal rows
    assert lines[4] == "| fwd | bf16 | 64 | no | 1.000= / 0.90 | 1.000= / 0.90 | 1.000= / 0.90 |"
    assert lines[6].startswith("| fwd | bf16 | 128 | no | 1.050 / 0.95 |")
    assert lines[-1].endswith("| 0.995 / 0.90 |")     # bwd d=128 causal s=4096
    assert lines[-1].startswith("| bwd | bf16 | 128 | yes |")
    txt = bench.tuned_verdict(recs)
    assert txt.startswith("tuned >= heuristic in 23/24 cells (min ratio 0.995); "
                          "worst: bwd bf16 d=128 causal s=4096; 12 cells run the heuristic's own config")
    assert "1 of the misses within 1% (timing noise)" in txt and txt.endswith("-> FAIL")
    ok = [dict(r, ms=r["ms"] / 1.01, tflops=r["tflops"] * 1.01)     # now 0.5 % faster
          if r["impl"] == "cuflash_tuned" and r["kernel"] == "bwd" and r["hdim"] == 128
          and r["causal"] and r["seqlen"] == 4096 else r for r in recs]
    txt = bench.tuned_verdict(ok)
    assert txt.startswith("tuned >= heuristic in 24/24 cells (min ratio 1.000)") and txt.endswith("PASS")


def test_tuned_verdict_counts_missing_numbers():
    recs = [r for r in fake_tuned_records()
            if not (r["impl"] == "cuflash_heuristic" and r["kernel"] == "fwd" and r["hdim"] == 128
                    and r["seqlen"] == 1024 and not r["causal"])]
    for r in recs:
        if r["impl"] == "cuflash_tuned" and r["kernel"] == "fwd" and r["hdim"] == 64 and r["seqlen"] == 1024:
            r.pop("tflops")
            r["error"] = "CUDAError"
    txt = bench.tuned_verdict(recs)
    assert txt.startswith("tuned >= heuristic in 20/24 cells (min ratio 0.995)")
    assert "3 cells without both numbers (errors)" in txt and txt.endswith("FAIL")
    assert bench.tuned_verdict([r for r in recs if r["impl"].startswith("sdpa")]) == \
        "tuned >= heuristic in 0/0 cells (no tuned/heuristic pairs) -> FAIL"
    assert "| - / " in bench.tuned_table(recs)


def test_tuned_line():
    recs = fake_tuned_records()
    key = lambda r: (r["kernel"], r["hdim"], r["causal"], r["seqlen"])  # noqa: E731
    line = bench.tuned_line([r for r in recs if key(r) == ("fwd", 128, False, 2048)])
    assert line.startswith("fwd bf16 d=128 causal=False s= 2048 b= 8 TFLOPs: cuflash_tuned=")
    assert "sdpa_cudnn=error" in line and "tuned/heuristic=1.050  tuned/flash=0.95  [T]" in line
    same = [r for r in recs if key(r) == ("bwd", 64, True, 1024)]
    assert "tuned/heuristic=1.000 (same config)" in bench.tuned_line(same)


def test_tuned_write_json_csv_png(tmp_path):
    recs = fake_tuned_records()
    bench.write(recs, tmp_path, "bench_tuned", "tflops", log=lambda *_: None,
                plotter=bench.plot_tuned)
    assert json.loads((tmp_path / "bench_tuned.json").read_text()) == recs
    with open(tmp_path / "bench_tuned.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(recs)
    for key in ("impl", "kernel", "dtype", "hdim", "causal", "batch", "seqlen", "ms", "tflops",
                "config", "source", "same_config", "error"):
        assert key in rows[0]
    err = [r for r in rows if r["error"]]
    assert len(err) == 1 and err[0]["impl"] == "sdpa_cudnn" and err[0]["ms"] == ""
    tuned = [r for r in rows if r["impl"] == "cuflash_tuned"]
    assert {r["same_config"] for r in tuned} == {"True", "False"}
    assert {r["same_config"] for r in rows if r["impl"] == "sdpa_flash"} == {""}
    if HAS_MPL:
        assert (tmp_path / "bench_tuned.png").stat().st_size > 1000


def test_time_interleaved_alternates(monkeypatch):
    order = []

    def fake_time_ms(fn, warmup=3, reps=20, inner=10):
        assert (warmup, reps) == (0, 1)
        order.append(fn.__name__)
        return {"a": 1.0, "b": 2.0}[fn.__name__] + len(order) * 1e-3   # drift

    def a():
        pass

    def b():
        pass

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    ms = bench.time_interleaved([a, b], warmup=1, reps=5)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    # medians of samples 1, 4, 5, 8, 9 (a) and 2, 3, 6, 7, 10 (b): drift hits both alike
    assert ms == pytest.approx([1.005, 2.006])


def _fake_tuned_configs(kernel, hdim, dtype, causal, seqlen, device=0):
    """Configs without a GPU: the heuristic is the tuned config at s=32; at s=64 the fwd's
    tuned config differs (another Bc), the bwd's is the heuristic's."""
    from cuflash.config import default_bwd_config, default_fwd_config

    if kernel == "fwd":
        heur = default_fwd_config(hdim, dtype, causal)
        tuned = heur if seqlen < 64 else heur.replace(Bc=32 if heur.Bc != 32 else 64)
    else:
        heur = default_bwd_config(hdim, dtype, causal)
        tuned = heur
    return tuned, ("tuned fake.yaml" if tuned != heur else "heuristic (fake)"), heur, "heuristic"


def test_tuned_loop_on_cpu(tmp_path, monkeypatch):
    """run_tuned's loop on CPU tensors (cuflash's reference path; the configs and the
    CUDA-event timer faked): same configs timed once, different ones interleaved."""
    timed = []

    def fake_time_ms(fn, warmup=3, reps=20, inner=10):
        fn()
        timed.append((fn, reps))
        # interleaved samples: a linear drift (1, 2, 3, ...) that A B B A rounds cancel
        return 2.0 if reps > 1 else float(sum(r == 1 for _, r in timed))

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    monkeypatch.setattr(bench, "tuned_configs", _fake_tuned_configs)
    log = []
    recs = bench.run_tuned(hdims=(64,), seqlens=(32, 64), dtypes=("bf16",), causals=(True,),
                           reps=4, out_dir=tmp_path, log=log.append, device="cpu", total_tokens=64)
    cells = bench.tuned_cells(recs)
    assert list(cells) == [("fwd", "bf16", 64, True, 32), ("fwd", "bf16", 64, True, 64),
                           ("bwd", "bf16", 64, True, 32), ("bwd", "bf16", 64, True, 64)]
    for key, cell in cells.items():
        assert list(cell) == list(bench.TUNED_IMPLS)
        assert "error" in cell["sdpa_cudnn"]                  # no cuDNN attention on the CPU
        t, h = cell["cuflash_tuned"], cell["cuflash_heuristic"]
        assert "error" not in t and "error" not in h, (t, h)
        assert t["source"] != "" and h["source"] == "heuristic"
        f = bench.flops(t["batch"], t["nheads"], key[4], key[4], 64, True, key[0])
        assert t["tflops"] == pytest.approx(f / t["ms"] / 1e9)
        if key == ("fwd", "bf16", 64, True, 64):
            assert t["same_config"] is False and t["config"] != h["config"]
            assert t["interleaved"] and h["interleaved"]
            assert t["ms"] == h["ms"] == 4.5      # medians of samples 1 4 5 8 and 2 3 6 7
            assert t["source"] == "tuned fake.yaml"
        else:
            assert t["same_config"] is True and t["config"] == h["config"]
            assert t["ms"] == h["ms"] == 2.0 and "interleaved" not in t
    # one time_ms call per same-config cell and per sdpa_flash cell (sdpa_cudnn raises
    # before it is counted); the differing cell: 4 rounds x 2 single samples
    assert sum(reps == 4 for _, reps in timed) == 3 + 4
    assert sum(reps == 1 for _, reps in timed) == 8
    assert json.loads((tmp_path / "cpu" / "bench_tuned.json").read_text()) == recs
    assert any(line.startswith("tuned >= heuristic in ") for line in log)
    assert "\n| kernel | dtype | d | causal | 32 | 64 |\n" in "\n".join(log)
    if HAS_MPL:
        assert (tmp_path / "cpu" / "bench_tuned.png").exists()


def test_tuned_mode_cli(capsys):
    from cuflash import _gpu
    from cuflash.__main__ import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "tuned" in out and "--kernels" in out and "tuned >= heuristic in N/M cells" in out
    if _gpu.available():
        return
    with pytest.raises(_gpu.NoGPUError):
        bench.main(["--mode", "tuned", "--hdims", "64", "--seqlens", "512"])


# ---------------------------------------------------------------------------------------
# train_check: task data and the comparison

def test_batches_are_deterministic_and_periodic():
    table = train_check.walk_table(64, 4, seed=3)
    assert table.shape == (64, 4)
    assert torch.equal(table, train_check.walk_table(64, 4, seed=3))
    a = train_check.make_batch(5, 8, 100, table, 3, 8, 32)
    b = train_check.make_batch(5, 8, 100, table, 3, 8, 32)
    c = train_check.make_batch(6, 8, 100, table, 3, 8, 32)
    assert a.shape == (8, 101) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < 64
    for row in a:
        # the smallest period that repeats the row lies in 8..32
        p = next(p for p in range(1, 33) if torch.equal(row[p:], row[:-p]))
        assert 1 <= p <= 32
        # consecutive tokens within a period follow the walk graph
        for t in range(min(p, 100) - 1):
            if t + 1 < p:
                assert int(row[t + 1]) in table[int(row[t])].tolist()


def test_smooth():
    assert train_check.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert train_check.smooth([2.0], 10) == [2.0]


def _runs(ref, cand, noise=None):
    runs = {"cuflash": dict(loss=cand), "sdpa_flash": dict(loss=ref)}
    if noise is not None:
        runs["sdpa_efficient"] = dict(loss=noise)
    return runs


def test_compare_pass_and_fail():
    ref = [5.0 * math.exp(-i / 40) + 0.5 for i in range(300)]
    close = [x * 1.003 for x in ref]
    noise = [x * 0.9999 for x in ref]
    res = train_check.compare(_runs(ref, close, noise), "cuflash", "sdpa_flash", "sdpa_efficient",
                              vocab=512, window=25)
    assert res["pass"] and res["finite"] and res["final_ok"] and res["curve_ok"]
    final_ref = res["final_smoothed"]["sdpa_flash"]
    assert res["tol_final"] == pytest.approx(max(5 * res["noise_final_diff"], 0.01 * final_ref, 0.005))
    assert res["final_diff_over_noise"] == pytest.approx(30, rel=1e-6)
    # 3 % off at the end: fails the final check (tol 1 %), passes the curve (2 % + 0.005)
    off = [x * 1.03 for x in ref]
    res = train_check.compare(_runs(ref, off, noise), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 25)
    assert not res["pass"] and not res["final_ok"]
    # a model that stops learning halfway: fails the final and the curve checks
    stuck = ref[:150] + [ref[150]] * 150
    res = train_check.compare(_runs(ref, stuck, noise), "cuflash", "sdpa_flash", "sdpa_efficient",
                              vocab=512, window=25)
    assert not res["pass"] and not res["final_ok"] and not res["curve_ok"]
    # a bump mid-curve that recovers: only the curve check catches it
    bump = [x * (1.2 if 100 <= i < 140 else 1.0) for i, x in enumerate(ref)]
    res = train_check.compare(_runs(ref, bump, noise), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 25)
    assert res["final_ok"] and not res["curve_ok"] and not res["pass"]
    # a noisy reference widens the tolerances
    wide = [x * 1.02 for x in ref]
    res = train_check.compare(_runs(ref, off, wide), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 25)
    assert res["pass"]
    # a NaN fails
    nan = ref[:-1] + [math.nan]
    assert not train_check.compare(_runs(ref, nan), "cuflash", "sdpa_flash", None, 512, 25)["pass"]


def test_compare_init_check():
    ref = [1.0] * 50
    init = {"cuflash": dict(loss=1.0, loss_diff=2e-5, grad_cos=0.999998, grad_rel_l2=3e-3),
            "sdpa_flash": dict(loss=1.0, loss_diff=0.0, grad_cos=1.0, grad_rel_l2=0.0),
            "sdpa_efficient": dict(loss=1.0, loss_diff=1e-5, grad_cos=0.999998, grad_rel_l2=2e-3)}
    res = train_check.compare(_runs(ref, ref, ref), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 5, init)
    assert res["init_ok"] and res["pass"]
    assert res["init_tol_grad_rel_l2"] == pytest.approx(6e-3)
    init["cuflash"]["grad_rel_l2"] = 0.05          # a gradient 5 % off
    res = train_check.compare(_runs(ref, ref, ref), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 5, init)
    assert not res["init_ok"] and not res["pass"]
    init["cuflash"].update(grad_rel_l2=3e-3, loss_diff=0.01)   # a forward 1e-2 nats off
    res = train_check.compare(_runs(ref, ref, ref), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 5, init)
    assert not res["init_ok"]


def test_same_init_for_every_attention():
    mc, _ = train_check.SIZES["tiny"]
    a = train_check.build_model(mc, "cuflash", 7, "cpu")
    b = train_check.build_model(mc, "sdpa", 7, "cpu")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


@pytest.fixture
def one_thread():
    # a 2-core CI box with another busy process: 2 OpenMP threads are 100x slower than 1
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_train_check_tiny_cpu_sdpa(tmp_path, one_thread):
    """The whole pipeline (init check, training, comparison, JSON, plot) with SDPA only."""
    res = train_check.run_check(("sdpa", "sdpa_math", "sdpa"), "tiny", 2, "cpu", tmp_path,
                                log=lambda *_: None)
    assert res["comparison"]["pass"]
    data = json.loads((tmp_path / "cpu" / "train_check.json").read_text())
    assert set(data["runs"]) == {"sdpa", "sdpa_math"}
    assert len(data["runs"]["sdpa"]["loss"]) == 2
    if HAS_MPL:
        assert (tmp_path / "cpu" / "train_check.png").exists()


def test_train_check_tiny_cpu_cuflash(tmp_path, one_thread):
    """cuflash on CPU tensors runs through the NumPy reference (forward and backward)."""
    try:
        rc = train_check.main(["--device", "cpu", "--steps", "3", "--out", str(tmp_path)])
    except NotImplementedError as exc:
        pytest.skip(f"cuflash on torch CPU tensors / autograd not available yet: {exc}")
    data = json.loads((tmp_path / "cpu" / "train_check.json").read_text())
    assert set(data["runs"]) == {"cuflash", "sdpa"}
    assert data["comparison"]["finite"]
    assert rc == 0, data["comparison"]
