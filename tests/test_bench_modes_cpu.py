"""The overhead, startup and io modes' pure parts without a GPU: record shapes and tables from
synthetic data, the child-process plumbing (a stand-in child), the IO FLOP formula, ncu CSV
parsing (and the ncu plumbing, with a stand-in ncu), and the IO Markdown table."""
import json
import sys
import textwrap

import pytest

from cuflash.bench import io as iomode
from cuflash.bench import overhead, startup

pytest.importorskip("torch")


# ---------------------------------------------------------------------------------------
# overhead

def fake_overhead_records():
    recs = []
    for path, us in (("torch_fwd", {"cuflash": 12.0, "sdpa_flash": 24.0, "sdpa_cudnn": 30.0}),
                     ("torch_fwdbwd", {"cuflash": 60.0, "sdpa_flash": 80.0, "sdpa_cudnn": 90.0}),
                     ("cupy_fwd", {"cuflash": 8.0})):
        for impl, v in us.items():
            recs.append(dict(impl=impl, path=path, batch=1, seqlen=128, nheads=4, hdim=64,
                             causal=True, dtype="bf16", calls=2000, us_per_call=v))
    for impl, wall in (("cuflash", 1.2), ("sdpa_flash", 1.1), ("sdpa_cudnn", 1.0)):
        recs.append(dict(impl=impl, path="eager_fwd", us_per_call=wall * 1e3, wall_ms=wall,
                         tflops=100 / wall, kernel_ms=wall - 0.1, kernel_tflops=100 / (wall - 0.1)))
    return recs


def test_overhead_table():
    lines = overhead.table(fake_overhead_records()).splitlines()
    assert lines[0] == "| path | cuflash µs | sdpa_flash µs | sdpa_cudnn µs | cuflash / sdpa_flash |"
    assert lines[2] == "| torch_fwd | 12.0 | 24.0 | 30.0 | 0.50 |"
    assert lines[4] == "| cupy_fwd | 8.0 | - | - | - |"           # SDPA has no CuPy path
    assert lines[5].startswith("| eager_fwd | 1200.0 | 1100.0 | 1000.0 | 1.09 |")


def test_overhead_record_shapes_without_gpu():
    # no CUDA here: each record says why instead of raising
    recs = overhead.host_records("torch_fwd", overhead.TINY, calls=10, rounds=2)
    assert [r["impl"] for r in recs] == ["cuflash", "sdpa_flash", "sdpa_cudnn"]
    rec = recs[0]
    assert (rec["impl"], rec["path"], rec["batch"], rec["seqlen"], rec["nheads"], rec["hdim"]) == \
        ("cuflash", "torch_fwd", 1, 128, 4, 64)
    assert rec["causal"] and rec["dtype"] == "bf16" and rec["calls"] == 10 and rec["rounds"] == 2
    if "us_per_call" not in rec:
        assert rec["error"]
    cupy_recs = overhead.host_records("cupy_fwd", calls=5, rounds=1)   # SDPA has no CuPy path
    assert [r["impl"] for r in cupy_recs] == ["cuflash"] and cupy_recs[0]["dtype"] == "fp16"
    rec = overhead.eager_record("cuflash", "eager_fwd", reps=1)
    assert (rec["batch"], rec["seqlen"], rec["nheads"], rec["hdim"]) == (8, 2048, 16, 128)
    assert overhead.TINY.causal and overhead.EAGER.causal


def test_overhead_feature_rows_without_gpu():
    """The feature calls' rows (issue 12): every case beside SDPA's nearest calls; without CUDA each
    record says why; the tables from records."""
    recs = overhead.feature_host_records(calls=5, rounds=1)
    cases = [(r["path"], r["case"], r["impl"]) for r in recs]
    assert ("feature_fwd", "window", "cuflash") in cases and ("feature_fwdbwd", "varlen",
                                                                 "sdpa_flash+nested") in cases
    assert len(cases) == 2 * sum(1 + len(overhead.FEATURE_SDPA[c]) for c in overhead.FEATURE_CASES)
    assert all("us_median" in r or r["error"] for r in recs)
    assert overhead.feature_window(overhead.TINY) == (64, 0)
    assert overhead.feature_window(overhead.EAGER) == (1024, 0)
    assert overhead.varlen_lens(overhead.TINY) == (60, 28, 40)
    assert sum(overhead.varlen_lens(overhead.EAGER)) == 8 * 2048
    rec = overhead.eager_record("cuflash", "feature_eager_fwdbwd", case="window", reps=1)
    assert rec["case"] == "window" and rec["causal"] and (rec.get("error") or "tflops" not in rec)
    fake = [dict(path="feature_fwd", case=c, impl=i, us_median=u)
            for c, i, u in (("causal", "cuflash", 20.0), ("window", "cuflash", 25.0),
                            ("window", "sdpa_efficient+mask", 30.0))]
    lines = overhead.feature_table(fake).splitlines()
    assert lines[3] == "| fwd | window | 25.0 | 1.25 | efficient+mask 30.0 |"
    fake = [dict(path="feature_eager_fwdbwd", case=c, impl=i, wall_ms=m)
            for c, i, m in (("causal", "cuflash", 2.0), ("softcap", "cuflash", 2.2))]
    assert overhead.feature_eager_table(fake).splitlines()[3] == "| fwdbwd | softcap | 2.200 | 1.10 | - |"


# ---------------------------------------------------------------------------------------
# startup

def test_parse_child():
    out = "noise\nCUFLASH_STARTUP {\"impl\": \"cuflash\", \"first_call_s\": 1.5}\n"
    assert startup.parse_child(out) == {"impl": "cuflash", "first_call_s": 1.5}
    assert startup.parse_child("nothing") is None


def test_summarize_and_comparison():
    runs = [dict(impl="cuflash", first_call_s=x, import_s=0.1 * x, child_wall_s=3.0)
            for x in (0.9, 0.7, 0.8)]
    rec = startup.summarize("cuflash", "warm", runs + [{"impl": "cuflash", "error": "exit 1: boom"}])
    assert rec["impl"] == "cuflash" and rec["cache"] == "warm"
    assert rec["first_call_s"] == 0.8 and rec["first_call_runs"] == [0.9, 0.7, 0.8]
    assert rec["import_s"] == pytest.approx(0.08) and rec["errors"] == ["exit 1: boom"]
    cold = startup.summarize("cuflash", "cold", [dict(impl="cuflash", first_call_s=20.0,
                                                      import_s=0.1, child_wall_s=25.0)])
    flash = startup.summarize("sdpa_flash", "n/a", [dict(impl="sdpa_flash", first_call_s=0.5,
                                                         child_wall_s=3.0)])
    assert "import_s" not in flash
    cmp_ = startup.comparison([rec, cold, flash])
    assert cmp_["cuflash_warm_first_call_s"] == 0.8 and cmp_["budget_s"] == 0.5
    assert cmp_["sdpa_flash"]["plus_budget_s"] == 1.0
    assert cmp_["sdpa_flash"]["cuflash_minus_that_s"] == pytest.approx(-0.2)
    (text,) = startup.comparison_lines(cmp_)
    assert text == ("cuflash warm first call 0.800 s vs sdpa_flash first call + 0.5 s = 1.000 s: "
                    "difference -0.200 s")
    failed = startup.summarize("cuflash", "warm", [{"impl": "cuflash", "error": "x"}])
    assert failed["first_call_s"] is None
    assert "no number" in startup.comparison_lines(startup.comparison([failed, flash]))[0]


def test_child_plumbing(tmp_path, monkeypatch):
    """child() runs a fresh interpreter with CUPY_CACHE_DIR set and this cuflash importable."""
    script = textwrap.dedent('''
        import json, os, sys
        import cuflash
        print("CUFLASH_STARTUP " + json.dumps({"impl": sys.argv[1], "call": sys.argv[2],
              "first_call_s": 0.25, "cache": os.environ["CUPY_CACHE_DIR"], "shape": sys.argv[3:7],
              "profile": os.environ.get("CUFLASH_STARTUP_PROFILE"), "cuflash": cuflash.__file__}))
    ''')
    monkeypatch.setattr(startup, "CHILD", script)
    rec = startup.child("cuflash", str(tmp_path), (1, 2, 3, 4), timeout=60)
    assert rec["first_call_s"] == 0.25 and rec["cache"] == str(tmp_path)
    assert rec["shape"] == ["1", "2", "3", "4"] and rec["child_wall_s"] > 0
    assert rec["call"] == "causal" and rec["profile"] is None
    rec = startup.profile_child("varlen", str(tmp_path), str(tmp_path / "p.prof"), (1, 2, 3, 4))
    assert rec["call"] == "varlen" and rec["profile"] == str(tmp_path / "p.prof")
    import cuflash
    assert rec["cuflash"] == cuflash.__file__
    monkeypatch.setattr(startup, "CHILD", "import sys; sys.exit('boom')")
    assert startup.child("cuflash", str(tmp_path))["error"] == "exit 1: boom"
    assert startup.child("cuflash", str(tmp_path), call="window")["call"] == "window"


def test_startup_plan():
    plan = startup.plan_of(["causal", "softcap", "varlen"])
    assert plan == [("causal", "cuflash", "warm"), ("causal", "cuflash", "cold"),
                    ("causal", "sdpa_flash", "n/a"), ("causal", "sdpa_cudnn", "n/a"),
                    ("softcap", "cuflash", "warm"), ("softcap", "cuflash", "cold"),
                    ("varlen", "cuflash", "warm"), ("varlen", "cuflash", "cold"),
                    ("varlen", "sdpa_flash+nested", "n/a")]
    assert len(startup.plan_of(startup.DEFAULT_CALLS)) == 35   # kvcache_b1: 4, cross_entropy: 3
    # mix, deterministic, varlen_mix: no peers; rms_norm (not a default call): cuflash warm / cold, torch
    assert len(startup.plan_of(startup.CALLS)) == 35 + 3 * 2 + 3
    with pytest.raises(ValueError, match="calls: unknown call 'decode'"):
        startup.plan_of(["decode"])


def _rec(call, impl, cache, t, imp=None):
    runs = [dict(impl=impl, call=call, first_call_s=t, child_wall_s=4.0,
                 **({} if imp is None else {"import_s": imp}))]
    return startup.summarize(impl, cache, runs, call)


def test_startup_comparisons_and_table():
    records = [_rec("causal", "cuflash", "warm", 0.30, 0.11), _rec("causal", "cuflash", "cold", 1.25, 0.1),
               _rec("causal", "sdpa_flash", "n/a", 0.004), _rec("causal", "sdpa_cudnn", "n/a", 0.066),
               _rec("window", "cuflash", "warm", 1.8, 0.1), _rec("window", "cuflash", "cold", 4.0, 0.1),
               _rec("window", "sdpa_efficient+mask", "n/a", 0.2), _rec("softcap", "cuflash", "warm", 0.4, 0.1)]
    assert records[4]["call"] == "window"
    cmps = startup.comparisons(records)
    assert list(cmps) == ["causal", "window", "softcap"]
    assert cmps["window"]["cuflash_warm_first_call_s"] == 1.8
    assert cmps["window"]["sdpa_efficient+mask"]["cuflash_minus_that_s"] == pytest.approx(1.1)
    assert cmps["softcap"]["sdpa_call"] == "causal"   # no softcap in SDPA: its causal call
    assert cmps["softcap"]["sdpa_flash"]["cuflash_minus_that_s"] == pytest.approx(0.4 - 0.004 - 0.5)
    assert startup.comparison(records[:4] + records[-1:], call="softcap")["sdpa_call"] == "causal"
    assert "sdpa_call" not in startup.comparison(records[-1:], call="softcap")
    assert startup.comparison(records) == cmps["causal"]   # the causal call's, as before
    assert "sdpa_efficient+mask" not in cmps["causal"]
    (line,) = startup.comparison_lines(cmps["window"], "window")
    assert line.startswith("cuflash warm first call (window) 1.800 s vs sdpa_efficient+mask")
    # records from before the call field are the causal call's
    old = [{k: v for k, v in r.items() if k != "call"} for r in records[:4]]
    assert startup.comparison(old) == cmps["causal"]
    lines = startup.table(records).splitlines()
    assert lines[2] == "| causal | 0.300 | 1.250 | 0.110 | flash 0.004, cudnn 0.066 | -0.204 |"
    assert lines[3] == "| window | 1.800 | 4.000 | 0.100 | efficient+mask 0.200 | +1.100 |"
    assert lines[4] == ("| softcap | 0.400 | - | 0.100 | none (causal: flash 0.004, cudnn 0.066) "
                        "| -0.104 |")
    ce = [_rec("cross_entropy", "cuflash", "warm", 0.2, 0.1), _rec("cross_entropy", "torch", "n/a", 0.05)]
    assert startup.comparisons(ce)["cross_entropy"]["torch"]["cuflash_minus_that_s"] == pytest.approx(-0.35)
    assert startup.table(ce).splitlines()[2] == "| cross_entropy | 0.200 | - | 0.100 | torch 0.050 | -0.350 |"
    (text, _) = startup.comparison_lines(cmps["softcap"], "softcap")
    assert text.startswith("cuflash warm first call (softcap), SDPA's causal call 0.400 s vs sdpa_flash")


@pytest.mark.parametrize("impl,call", [("cuflash", "varlen"), ("cuflash", "kvcache"), ("sdpa_cudnn", "kvcache_b1"),
                                       ("cuflash", "kvcache_b1"), ("cuflash", "cross_entropy"),
                                       ("torch", "cross_entropy"), ("cuflash", "rms_norm"), ("torch", "rms_norm"),
                                       ("cuflash", "causal_fwdbwd"), ("sdpa_cudnn+mask", "alibi"),
                                       ("cuflash", "mix"), ("cuflash", "deterministic"), ("cuflash", "varlen_mix")])
def test_startup_child_calls_dry_run(tmp_path, impl, call):
    """The real child script on torch CPU tensors (CUFLASH_STARTUP_CPU=1: cuflash's reference,
    SDPA's math backend): its inputs and calls run and it prints its record."""
    pytest.importorskip("torch")
    rec = startup.child(impl, str(tmp_path), (2, 64, 2, 16), timeout=120, call=call,
                        env={"CUFLASH_STARTUP_CPU": "1"})
    assert "error" not in rec, rec
    assert rec["call"] == call and rec["first_call_s"] > 0
    assert ("import_s" in rec) == (impl == "cuflash")


def test_startup_child_script_compiles():
    compile(startup.CHILD, "<startup child>", "exec")


# ---------------------------------------------------------------------------------------
# io

def test_io_gflops_formula():
    unit = 64 * 16 * 1024 * 1024 * 64
    assert iomode.gflops("standard", 64, 16, 1024, 64) == pytest.approx(12 * unit / 1e9)
    assert iomode.gflops("cuflash", 64, 16, 1024, 64) == pytest.approx(14 * unit / 1e9)
    assert iomode.gflops("sdpa_flash", 64, 16, 1024, 64, causal=True) == pytest.approx(7 * unit / 1e9)
    assert iomode.gflops("standard", 64, 16, 1024, 64, causal=True) == pytest.approx(12 * unit / 1e9)
    assert "12·b·h·s²·d" in iomode.FORMULA and "14·b·h·s²·d" in iomode.FORMULA
    assert iomode.MAIN == dict(batch=64, nheads=16, seqlen=1024, hdim=64)


NCU_CSV = textwrap.dedent('''\
    ==PROF== Connected to process 1234 (/usr/bin/python3)
    ==PROF== Profiling "gemm": 0%....50%....100% - 1 pass
    "ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
    "0","1234","python3","127.0.0.1","gemm","1","7","(256, 1, 1)","(64, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"
    "0","1234","python3","127.0.0.1","gemm","1","7","(256, 1, 1)","(64, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","524,288"
    "1","1234","python3","127.0.0.1","softmax","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","2.5"
    "1","1234","python3","127.0.0.1","softmax","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
    ==PROF== Disconnected from process 1234
''')


def test_parse_ncu_csv():
    got = iomode.parse_ncu_csv(NCU_CSV)
    assert got == {"read_bytes": 1048576 + 2.5e6, "write_bytes": 524288, "kernels": 2}
    with pytest.raises(ValueError):
        iomode.parse_ncu_csv("==PROF== No kernels were profiled.\n")


def test_io_child_command():
    cmd = iomode.child_cmd("standard", dict(iomode.MAIN), causal=True)
    assert cmd[:5] == [sys.executable, "-m", "cuflash.bench.io", "--child", "standard"]
    assert cmd[5:] == ["--batch", "64", "--nheads", "16", "--seqlen", "1024", "--hdim", "64", "--causal"]


def test_hbm_bytes_with_a_stand_in_ncu(tmp_path):
    """hbm_bytes() passes the metrics and the child command to ncu, and sums ncu's CSV log."""
    fake = tmp_path / "ncu"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f'''
        import json, sys
        args = sys.argv[1:]
        assert args[args.index("--metrics") + 1] == "dram__bytes_read.sum,dram__bytes_write.sum"
        assert "--csv" in args and args[args.index("--profile-from-start") + 1] == "off"
        child = args[args.index("-m") + 1:]
        open(args[args.index("--log-file") + 1], "w").write({NCU_CSV!r})
        impl = child[child.index("--child") + 1]
        if impl == "standard":
            print("CUFLASH_IO " + json.dumps({{"impl": impl, "oom": True, "error": "OutOfMemoryError"}}))
        else:
            print("CUFLASH_IO " + json.dumps({{"impl": impl}}))
    '''))
    fake.chmod(0o755)
    got = iomode.hbm_bytes("cuflash", dict(iomode.MAIN), False, str(fake), timeout=60)
    assert got == {"read_bytes": 1048576 + 2.5e6, "write_bytes": 524288, "kernels": 2}
    assert iomode.hbm_bytes("standard", dict(iomode.MAIN), False, str(fake), timeout=60)["oom"]


def fake_io_records():
    main = [dict(impl=i, table="main", batch=64, nheads=16, seqlen=1024, hdim=64, causal=False,
                 gflops=iomode.gflops(i, 64, 16, 1024, 64), hbm_gb=gb, runtime_ms=ms, oom=False)
            for i, gb, ms in (("standard", 41.0, 30.0), ("sdpa_flash", 4.0, 5.0), ("cuflash", 4.2, 5.2))]
    growth = []
    for s in (1024, 16384):
        for i in iomode.IMPLS:
            oom = i == "standard" and s == 16384
            growth.append(dict(impl=i, table="growth", batch=1, nheads=16, seqlen=s, hdim=64,
                               causal=False, gflops=iomode.gflops(i, 1, 16, s, 64),
                               hbm_gb=None if oom else s / 1e4, runtime_ms=None if oom else s / 1e3,
                               oom=oom))
    return main, growth


def test_io_markdown():
    main, growth = fake_io_records()
    md = iomode.markdown(main, growth, "GPT-2 medium", "Fake GPU", ["a note"])
    lines = md.splitlines()
    assert lines[0] == "# Attention IO: GPT-2 medium"
    assert "| Standard attention | 824.6 | 41.00 | 30.00 | 66.6 | 40.3 | 41.7 |" in lines
    assert "| SDPA flash | 962.1 | 4.00 | 5.00 | 75.2 | 4.4 | 7.3 |" in lines
    assert "| cuflash | 962.1 | 4.20 | 5.20 | 75.2 | 4.4 | 7.3 |" in lines
    assert "| 16384 | OOM | 1.638 | 1.638 | OOM | 16.38 | 16.38 |" in lines
    assert "- a note" in lines and any("14·b·h·s²·d" in x for x in lines)
    assert iomode.markdown(main, [], "s", "d", [])          # no growth table: still a table


def test_io_child_main_without_gpu(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is usable")
    assert iomode.child_main(["--child", "cuflash", "--batch", "1", "--nheads", "1",
                              "--seqlen", "16", "--hdim", "64"]) == 0
    rec = json.loads(capsys.readouterr().out.split("CUFLASH_IO ", 1)[1])
    assert rec["impl"] == "cuflash" and rec["error"] and rec["oom"] is False


def test_ncu_detection(monkeypatch):
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/x/libInjection.so")
    assert iomode.under_profiler()
    monkeypatch.delenv("CUDA_INJECTION64_PATH")
    assert not iomode.under_profiler()
    found = iomode.ncu_path()
    assert found is None or found.endswith("ncu")


def test_host_us_interleaved_rounds_and_contexts():
    import contextlib

    from cuflash.timing import host_us_interleaved

    order, entered = [], []

    @contextlib.contextmanager
    def pin():                      # single use, like sdpa_kernel: a fresh one per timing
        entered.append(1)
        yield

    fns = {"a": (lambda: order.append("a"), pin), "b": (lambda: order.append("b"), contextlib.nullcontext)}
    out = host_us_interleaved(fns, calls=3, rounds=4, sync=lambda: order.append("sync"))
    assert set(out) == {"a", "b"} and all(best <= med for best, med in out.values())
    timed = [x for x in order if x != "sync"][2:]          # after one warm-up call each
    assert timed == (["a"] * 3 + ["b"] * 3) * 4             # interleaved, round by round
    assert len(entered) == 1 + 4                            # warm-up, then every round


def test_startup_warm_by_warmup(tmp_path, monkeypatch):
    """warm_by_warmup runs python -m cuflash warmup ARGS with the child's cache directory."""
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(cmd=cmd, cache=env["CUPY_CACHE_DIR"])
        return type("R", (), {"returncode": 0, "stdout": "warming 3 kernels\n3/3 kernels in the cache, 1.0 s\n",
                              "stderr": "\r[###] 3/3"})()

    monkeypatch.setattr(startup.subprocess, "run", fake_run)
    rec = startup.warm_by_warmup(str(tmp_path), ["--features", "window+softcap"])
    assert seen["cmd"][1:] == ["-m", "cuflash", "warmup", "--features", "window+softcap"]
    assert seen["cache"] == str(tmp_path) and rec["returncode"] == 0 and rec["wall_s"] >= 0
    assert rec["tail"][-2:] == ["3/3 kernels in the cache, 1.0 s", "[###] 3/3"]
