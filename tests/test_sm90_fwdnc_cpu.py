"""sm90_fwd's explicit section size of the dynamic scheduler (``section``) and the non-causal timing
script (tests/sm90_fwd_nc_timing.py) without a GPU: the field's rules, name, encoding and run-time
param (the same kernel for every value), the section sizes it gives, and the timing's kernels (few
enough to compile in parallel first, valid, and without spills: nvcc -cubin, sm_90a)."""
import ctypes
import os
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _gpu, launch, registry
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd import MAX_SECTION, Sm90FwdConfig, sched_section
from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_fwd_nc_timing as timing  # noqa: E402

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
DYN = Sm90FwdConfig(BM=128, BN=176, stages=2, consumers=2, pingpong=True, persistent=True, head_dim=128,
                    dtype="bf16", causal=False, dynamic=True)


def problem(head_dim=128, batch=1, seqlen=16384, nheads=16, nheads_kv=16):
    return Problem("fwd", "bf16", batch, seqlen, seqlen, nheads, nheads_kv, head_dim, False)


def test_section_field():
    assert DYN.section == 0
    sec = DYN.replace(section=2)
    assert sec.validate(227 * 1024) is sec
    assert sec.name == DYN.name + "_sec2"
    # a run-time param: the kernel, its name expression and template arguments are the plain ones
    assert sec.kernel_name() == DYN.kernel_name() and sec.template_args() == DYN.template_args()
    assert sec.smem_bytes == DYN.smem_bytes
    # encoded only when set, and decoded back
    assert "section" not in FAM.encode(DYN)
    assert FAM.encode(sec).endswith(",section=2")
    assert FAM.decode(FAM.encode(sec), "bf16", False) == sec
    # outside the tuning space (a point without it is section 0)
    assert "section" not in FAM.space
    assert FAM.make(FAM.point(DYN), problem()).section == 0


@pytest.mark.parametrize("change,pattern", [
    (dict(section=-1), r"section must be 0 \(the L2 rule\) or 1\.\.1024"),
    (dict(section=MAX_SECTION + 1), r"section must be 0"),
    (dict(section=2, dynamic=False), r"section=2 orders the dynamic scheduler's tiles: it needs dynamic"),
])
def test_section_rules(change, pattern):
    import re

    why = DYN.replace(**change).problems(227 * 1024)
    assert len(why) == 1 and re.search(pattern, why[0]), why


def test_section_sizes():
    # the L2 rule (section 0): d128 16k, 8 MB of K and V per head -> 4 heads
    assert sched_section(problem()) == 4
    assert [sched_section(problem(), n) for n in (1, 2, 3, 16, 1000)] == [1, 2, 3, 16, 16]
    # GQA 16:4: n KV heads are 4n query heads; capped by the (head, batch) pairs
    p = problem(nheads_kv=4, batch=2)
    assert [sched_section(p, n) for n in (0, 1, 2, 8, 9)] == [16, 4, 8, 32, 32]
    # the heuristic keeps the L2 rule
    assert FAM.heuristic(problem()).section == 0


def test_static_params_take_the_section(monkeypatch):
    """The plan writes sched_section from the config's section (the L2 rule's for 0)."""
    launches = []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(ctypes.string_at(ptr, launch.struct_dtype("Sm90FwdParams").itemsize))

    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {"main": SimpleNamespace(
        kernel=SimpleNamespace(ptr=1000))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    monkeypatch.setattr(launch, "_zeroed_i32", lambda n, device, what: SimpleNamespace(ptr=0xC0DE00))
    monkeypatch.setattr(sm90_fwd, "_encoder", lambda *a: bytes(128))
    p = problem()
    st = (16384 * 16 * 128, 16 * 128, 128, 1)
    strides = {"q": st, "k": st, "v": st, "o": st}
    dt = launch.struct_dtype("Sm90FwdParams")
    for section, want in ((0, 4), (1, 1), (2, 2), (16, 16)):
        plan = launch.Plan(FAM, DYN.replace(section=section), p, strides, 0.1, 0)
        plan.run((1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20), 0, stream=7)
        assert int(np.frombuffer(launches[-1], dt)[0]["sched_section"]) == want


def test_timing_script_configs():
    bf16 = timing.all_configs(("bf16",))
    fp16 = timing.all_configs(("fp16",), rows_wanted=tuple(timing.FP16_ROWS.split(",")))
    tests = [c for c in timing.test_kernel_configs() if c.kernel_name() not in
             {k.kernel_name() for k in bf16 + fp16}]
    assert len(bf16) + len(fp16) + len(tests) <= 22         # compiled in parallel (16 cores) in < 45 s
    assert len(timing.test_kernel_configs()) == 10
    assert all(c.section == 0 and not c.causal for c in bf16 + fp16)
    for c in bf16 + fp16 + tests:
        assert c.validate(227 * 1024) is c
    assert len({c.kernel_name() for c in bf16}) == len(bf16)
    # every case has its heuristic, the old dynamic tile, its section rows and SDPA's two
    for d in (128, 256):
        for s in (2048, 16384):
            _, rows = timing.case_configs(d, s, "bf16", tuple(timing.CANDIDATES), quiet=True)
            assert {"heur", "dyn", "sec1", "sec2", "sec16", "rf"} <= set(rows)
            assert len(set(rows.values())) == len(rows)
            assert rows["sec1"].kernel_name() == rows["dyn"].kernel_name() != rows["heur"].kernel_name()
            assert rows["rf"] == rows["heur"].replace(rescale_first=True)


@needs_nvcc
def test_timing_kernels_compile_without_spills():
    from cuflash.compile import nvcc_compile

    # the timing's and the GPU test's tiles that no other CPU test compiles: rescale_first (with and
    # without pingpong, causal and not), d128 BN 128 with 3 stages, d256 BN 64 and one consumer
    # warpgroup at BN 96 (the plain persistent tiles differ from others' only by kPersistent, which
    # names the kernel and changes no code)
    cfgs = [c for c in timing.all_configs(("bf16",), rows_wanted=tuple(timing.CANDIDATES))
            if c.rescale_first or c.stages == 3 or c.BN in (64, 96)]
    cfgs += [c for c in timing.test_kernel_configs() if c.causal]
    assert len(cfgs) == 10 and sum(c.rescale_first for c in cfgs) == 7
    reports = nvcc_compile(cfgs, "sm_90a")
    assert len(reports) == len(cfgs)
    for r in reports:
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
        assert not any("serialized" in w for w in r.warnings), r


def test_heuristic_nc():
    """HEURISTIC_NC: plain non-causal calls at d128 / d256 from the 2048 bucket run the static
    persistent schedule (d256 without pingpong); causal calls, calls with features, shorter ones
    and other head dims keep the dynamic scheduler."""
    for s in (2048, 4096, 16384, 32768):
        d128, d256 = FAM.heuristic(problem(128, seqlen=s)), FAM.heuristic(problem(256, seqlen=s))
        d128, d256 = d128.replace(stream_tail=False), d256.replace(stream_tail=False)   # (HEURISTIC_STREAM_TAIL)
        assert d128.persistent and not d128.dynamic and d128.pingpong and d128.section == 0
        assert d256.persistent and not d256.dynamic and not d256.pingpong and d256.BN == 80
        assert not d128.rescale_first and not d256.rescale_first
        # the BN / TMA-store rule of d128 is unchanged
        assert (d128.BN, d128.tma_store) == ((176, False) if s >= 16384 else (160, True))
    assert FAM.heuristic(problem(128, seqlen=1024)).dynamic
    assert FAM.heuristic(problem(256, seqlen=1024)).pingpong
    for d in (64, 96, 192):
        assert FAM.heuristic(problem(d, seqlen=4096)).dynamic
    causal = Problem("fwd", "bf16", 1, 4096, 4096, 16, 16, 256, True)
    assert FAM.heuristic(causal).dynamic and FAM.heuristic(causal).pingpong
    window = Problem("fwd", "bf16", 1, 4096, 4096, 16, 16, 256, False, features=("window",), window=(256, 0))
    assert FAM.heuristic(window) == FAM.heuristic(window).replace(pingpong=True)
    for d in (128, 256):
        cfg = FAM.heuristic(problem(d, seqlen=8192))
        assert cfg.validate(227 * 1024) is cfg


RF = DYN.replace(head_dim=256, BN=80, pingpong=False, rescale_first=True)


def test_rescale_first_field():
    assert RF.validate(227 * 1024) is RF
    assert RF.name == "sm90fwd_bf16_d256_full_BM128_BN80_s2_c2_persist_dyn_rf"
    # kRescaleFirst is the last template argument but tile_overlap's, written only when set
    assert RF.kernel_name().endswith(", true, false, false, false, false, false, false, 0, false, true>")   # (kAlibiLinear false before it)
    assert not DYN.kernel_name().endswith("0, false>") and DYN.kernel_name().endswith(", true>")
    # (tile_overlap, kDropPacked, kDropEarly, kStreamTail, kPvOverlap, kMaskedCopy, kRagKeys, kPrefetch, kSAhead and
    # kDeferMax after it: the last ten of template_args)
    assert RF.template_args()[-11] is True and DYN.template_args()[-11] is False
    assert RF.smem_bytes == RF.replace(rescale_first=False).smem_bytes
    assert "rescale_first" not in FAM.encode(RF.replace(rescale_first=False))
    assert FAM.encode(RF).endswith(",rescale_first=1")
    assert FAM.decode(FAM.encode(RF), "bf16", False) == RF
    assert "rescale_first" not in FAM.space
    assert FAM.heuristic(problem(256)).rescale_first is False
    assert RF.replace(causal=True, pingpong=True).validate(227 * 1024)


@pytest.mark.parametrize("change,pattern", [
    (dict(lazy_rescale=True), r"rescale_first with lazy_rescale"),
    (dict(tree_max=True), r"rescale_first with lazy_rescale / fold_cap / p_smem / tree_max"),
    (dict(window=True), r"rescale_first with window / softcap / ALiBi / dropout / varlen"),
    (dict(dropout=True, BN=64), r"rescale_first with window / softcap / ALiBi / dropout / varlen"),
])
def test_rescale_first_rules(change, pattern):
    import re

    why = RF.replace(**change).problems(227 * 1024)
    assert any(re.search(pattern, w) for w in why), why


def test_rescale_first_is_for_plain_calls():
    """A call with a feature runs without it (a speed knob, as p_smem): for_problem drops it."""
    p = Problem("fwd", "bf16", 1, 4096, 4096, 8, 8, 256, False, features=("softcap",), softcap=30.0)
    cfg = FAM.for_problem(RF, p)
    assert cfg.softcap and not cfg.rescale_first
    plain = problem(256)
    assert FAM.for_problem(RF, plain) == RF
