"""bench --mode features without a GPU: the plan of what is timed, the records and the table
from synthetic timings, each case's problem and the configs selection gives it on sm_90 and
sm_80 (what the run precompiles), and the refusal without a GPU."""
import pytest

from cuflash import bench
from cuflash.bench import features as fm
from cuflash.select import choose
from cuflash.timing import Timing

pytest.importorskip("torch")


def fake_timing(ms):
    return Timing(ms, (ms * 0.99, ms, ms * 1.01), 10, False)


def test_plan_is_well_formed():
    plan = fm.plan()
    assert len(plan) == len(set(plan))
    cases = {c for _, _, _, c, _, _ in plan}
    assert cases == set(fm.DEFAULT_CASES)
    assert {"window1024_causal", "window1024", "softcap30_causal", "alibi_causal",
            "dropout0.1_causal", "varlen_causal"} <= cases
    for dtype, d, s, case, ps, impl in plan:
        assert (dtype, d, s) == ("bf16", 128, 8192) and ps in ("fwd", "fwdbwd")
    for case in fm.DEFAULT_CASES:
        for ps in fm.PASSES:
            impls = [i for *_, c, p, i in plan if c == case and p == ps]
            assert impls[:2] == ["cuflash", "cuflash_plain"], (case, ps)
            if case.startswith("varlen"):
                assert impls[2:] == ["sdpa_nested"]
            else:
                assert impls[2:] == list(fm.SDPA_IMPLS)


def test_sdpa_support_names_each_refusal():
    assert fm.sdpa_support("softcap30_causal")["sdpa_efficient"].startswith("SDPA has no softcap")
    for case in ("window1024", "alibi_causal"):
        got = fm.sdpa_support(case)
        assert got["sdpa_flash"] and not got["sdpa_efficient"] and not got["sdpa_math"] and not got["sdpa_cudnn"]
    assert not any(fm.sdpa_support("dropout0.1_causal").values())
    assert fm.sdpa_support("varlen") == {"sdpa_nested": ""}
    assert [fm.feature_of(c) for c in fm.DEFAULT_CASES] == ["window", "window", "softcap", "alibi",
                                                              "dropout", "varlen"]


def test_case_problems():
    p = fm.case_problem("window1024_causal", "bf16", 128, 8192)
    assert p.features == ("window",) and p.window == (1024, 0) and p.causal and p.batch == 2 and p.nheads == 16
    assert fm.case_problem("window1024", "bf16", 128, 8192, "bwd").window == (1024, 1024)
    assert fm.case_problem("softcap30", "bf16", 64, 8192).softcap == 30.0
    d = fm.case_problem("dropout0.1_causal", "bf16", 128, 8192)
    assert d.features == ("dropout",) and d.dropout_p == 0.1
    assert fm.case_problem("alibi", "fp16", 128, 2048).features == ("alibi",)
    assert fm.window_fraction("window1024_causal", 8192) == pytest.approx(0.2346, abs=1e-4)


def test_records_and_table():
    base = dict(dtype="bf16", hdim=128, seqlen=8192, batch=2, nheads=16, causal=True)
    flops = fm.useful_flops(2, 16, 128, fm.visible_pairs(8192, True, (1024, 0)), "fwd")
    timings = {"cuflash": fake_timing(0.25), "cuflash_plain": fake_timing(0.9),
               "sdpa_flash": "SDPA's flash backend takes no attn_mask", "sdpa_cudnn": fake_timing(2.0)}
    recs = fm.make_records("window1024_causal", "fwd", timings, base, flops, 0.2346,
                           {"cuflash": "cfgA", "cuflash_plain": "cfgB"})
    assert [r["impl"] for r in recs] == list(timings)
    cf, plain, flash = recs[0], recs[1], recs[2]
    assert cf["feature"] == "window1024_causal" and cf["pass"] == "fwd" and cf["config"] == "cfgA"
    assert cf["ms"] == 0.25 and cf["ratio_vs_plain"] == pytest.approx(0.278, abs=1e-3)
    assert cf["visible_fraction"] == 0.2346
    assert cf["cost_over_visible"] == pytest.approx(0.25 / 0.9 / 0.2346, abs=1e-3)
    assert cf["tflops"] == pytest.approx(flops / 0.25 / 1e9, abs=0.1)
    assert plain["ratio_vs_plain"] == 1.0 and "error" not in plain
    assert flash["error"].startswith("SDPA's flash") and "ms" not in flash and "tflops" not in flash
    both = fm.make_records("softcap30_causal", "fwdbwd", {"cuflash": fake_timing(3.0), "cuflash_plain": "boom"},
                           base, 1e12)
    assert "ratio_vs_plain" not in both[0] and "visible_fraction" not in both[0] and both[1]["error"] == "boom"
    text = fm.table(recs + both)
    lines = text.splitlines()
    assert lines[0].startswith("| feature | pass | dtype | d | seqlen | cuflash ms | cuflash_plain ms |")
    assert lines[0].endswith("| cuflash / plain | visible | cost / visible |")
    row = next(x for x in lines if x.startswith("| window1024_causal | fwd |"))
    assert "| 0.250 | 0.900 | - | 2.000 | 0.278 | 0.2346 | 1.184 |" in row
    assert fm.line(recs).startswith("window1024_causal fwd d128 s8192: cuflash 0.250 ms")


def test_flops_count_visible_elements():
    assert fm.visible_pairs(4, True) == 10 and fm.visible_pairs(4, False) == 16
    assert fm.visible_pairs(6, True, (1, 0)) == 11
    assert fm.useful_flops(1, 1, 1, 10, "fwdbwd") == pytest.approx(4 * 10 * 3.5)


@pytest.mark.parametrize("arch", [(9, 0), (8, 0)])
def test_every_case_has_a_kernel(arch):
    """What the run precompiles: selection finds a family for every case's fwd and bwd (the
    sm_90 window forward takes the aligned persistent tiles)."""
    chooser = lambda p, device: choose(p, arch)  # noqa: E731
    for case in fm.CASES:
        names, configs = fm.cuflash_configs(case, "bf16", 128, 8192, chooser=chooser)
        assert set(names) == {"cuflash", "cuflash_plain"}
        assert len(configs) == 4, (case, names)          # fwd + bwd, feature and plain
        if case.startswith("window") and arch == (9, 0):
            fwd = configs[0]
            assert fwd.family == "sm90_fwd" and fwd.window and fwd.BN == 128 and fwd.persistent


def test_mode_wiring_and_no_gpu(monkeypatch, tmp_path):
    a = bench.parser().parse_args(["--mode", "features"])
    assert a.feature_cases is None
    seen = {}
    monkeypatch.setattr(fm, "run", lambda **kw: seen.update(kw))
    bench.run_mode("features", a)
    assert seen["cases"] == fm.DEFAULT_CASES and seen["hdims"] == [128] and seen["seqlens"] == [8192]
    from cuflash import _gpu

    if not _gpu.available():
        monkeypatch.undo()
        with pytest.raises(_gpu.NoGPUError, match="features"):
            fm.run(out=str(tmp_path))
