"""CPU checks of sm90_bwd's launch order lpt (issue 14, the causal backward): K/V block 0 of a
group of (head, batch) pairs first, then block 1, ... (kLpt, fa2_bwd's grouped order).

The config field, name, template argument (appended last: a plain config keeps its name
expression), the space and the encoded form, the rules (not with varlen; for_problem drops it
there), the heuristic's switch, the params' head_group, the order itself (the host mirror of the
kernel's mapping: a bijection, K/V block n - 1 of a pair before block n, longest first), and the
nvcc/ptxas build (zero spills, no "wgmma serialized") of the new instantiations. No GPU needed.
"""
import itertools
import os
import shutil

import pytest

from cuflash import registry
from cuflash.compile import kernel_dir
from cuflash.families import fa2_bwd, sm90_bwd
from cuflash.families.sm90_bwd import Sm90BwdConfig, lpt_tile
from cuflash.problem import Problem

from test_sm90_bwd_sched_cpu import compile_clean  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")


def problem(head_dim=128, causal=True, deterministic=False, batch=2, seqlen=2048, nheads=16, features=(),
            **kw):
    return Problem("bwd", "bf16", batch, seqlen, seqlen, nheads, nheads, head_dim, causal, deterministic,
                   features=features, **kw)


def heur(d=128, causal=True):
    return Sm90BwdConfig(64, 128, 2, 2, d, "bf16", causal, dq_writer=True) if d == 128 else \
        Sm90BwdConfig(128, 128, 2, 2, d, "bf16", causal, dq_writer=True)


def test_field_name_template_encoding():
    plain = heur()
    lpt = plain.replace(lpt=True)
    assert lpt.name == plain.name + "_lpt" and lpt.problems() == []
    # appended last, after kVarlen: the plain config keeps its name expression (and its code)
    assert plain.kernel_name() == ("cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, true, false, "
                                   "false, false, false, false, false, false, true>")
    assert lpt.kernel_name() == plain.kernel_name()[:-1] + ", false, true>"
    assert lpt.template_args()[15:19] == (False, True, False, False) and len(lpt.template_args()) >= 19
    assert FAM.encode(plain) == FAM.encode(plain.replace(lpt=False)) and "lpt" not in FAM.encode(plain)
    assert FAM.decode(FAM.encode(lpt), "bf16", True) == lpt
    assert "lpt" not in FAM.space        # (measured no faster: a field outside the space)
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "bool kVarlen = false, bool kLpt = false, bool kDynamic = false, bool kDsDouble = false," in src


def test_rules_varlen_and_heuristic(monkeypatch):
    assert "lpt with varlen" in " ".join(heur().replace(lpt=True, varlen=True).problems())
    assert "lpt without causal" in " ".join(heur(causal=False).replace(lpt=True).problems())
    vp = problem(features=("varlen",))
    assert not FAM.for_problem(heur().replace(lpt=True), vp).lpt
    assert not FAM.for_problem(heur(causal=False).replace(lpt=True), problem(causal=False)).lpt
    for on in (False, True):
        monkeypatch.setattr(sm90_bwd, "HEURISTIC_LPT", on)
        for d, causal, det in itertools.product((64, 128), (False, True), (False, True)):
            p = problem(d, causal, det)
            cfg = FAM.for_problem(FAM.heuristic(p), p)
            assert cfg.lpt == (on and causal) and cfg.problems() == []


def test_params_head_group():
    p = problem(seqlen=2048, batch=8, nheads=16)
    n_kv = 2048 // 128
    for lpt in (False, True):
        cfg = heur().replace(lpt=lpt)
        ws = FAM.workspace(cfg, p)
        st = fa2_bwd.contiguous_strides(p)
        strides = {n: st for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")}
        params = FAM.static_params(cfg, p, strides, ws, 0.1, 132)
        assert params["head_group"] == (fa2_bwd.head_group(8 * 16, n_kv, 132) if lpt else 1)
    assert fa2_bwd.head_group(128, 16, 132) == 17     # two waves of 132 CTAs


@pytest.mark.parametrize("n_kv,n_pairs,group", [(16, 128, 17), (5, 8, 3), (1, 3, 2), (7, 1, 4), (128, 16, 3)])
def test_order_is_a_bijection_longest_first(n_kv, n_pairs, group):
    tiles = [lpt_tile(t, n_kv, n_pairs, group) for t in range(n_kv * n_pairs)]
    assert sorted(tiles) == sorted(itertools.product(range(n_kv), range(n_pairs)))
    pos = {tile: i for i, tile in enumerate(tiles)}
    for n, pair in itertools.product(range(1, n_kv), range(n_pairs)):
        assert pos[(n - 1, pair)] < pos[(n, pair)]        # the deterministic turns' order
    # inside a group, every pair's block n before any pair's block n + 1
    for t in range(1, len(tiles)):
        (n0, p0), (n1, p1) = tiles[t - 1], tiles[t]
        assert n1 >= n0 or p1 // group > p0 // group or n1 == 0


@needs_nvcc
def test_lpt_kernels_compile_clean():
    configs = [heur(d).replace(lpt=True) for d in (64, 128)]
    configs.append(heur(128).replace(lpt=True, dtype="fp16", window=True, softcap=True, alibi=True))
    configs.append(Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, True, lpt=True))   # deterministic
    assert all(c.problems() == [] for c in configs)
    assert compile_clean(configs) == []


# ---------------------------------------------------------------------------------------
# the dynamic scheduler (dynamic, kDynamic)

def test_dynamic_field_name_template_rules():
    plain = heur()
    dyn = plain.replace(dynamic=True)
    assert dyn.name == plain.name + "_dyn" and dyn.replace(lpt=True).name == plain.name + "_lpt_dyn"
    assert dyn.problems() == [] and dyn.replace(lpt=True).problems() == []
    # appended last, after kLpt: the plain and lpt configs keep their name expressions
    assert dyn.kernel_name() == plain.kernel_name()[:-1] + ", false, false, true>"
    assert dyn.template_args()[15:19] == (False, False, True, False) and len(dyn.template_args()) >= 19
    assert FAM.decode(FAM.encode(dyn), "bf16", True) == dyn and "dynamic" not in FAM.encode(plain)
    point = {k: v for k, v in FAM.point(plain).items() if k not in ("dynamic", "ds_double")}   # from before
    assert FAM.make(point, problem()).dynamic is False
    assert FAM.space["dynamic"] == (False, True)
    # 7 more mbarriers and the ring's slots and count
    assert dyn.replace(dq_writer=False).smem_bytes == plain.replace(dq_writer=False).smem_bytes + 8 * 7 + 24
    assert dyn.smem_bytes == plain.smem_bytes      # (inside dq_writer's 1024-byte alignment)
    for change, why in ((dict(deterministic=True, dq_writer=False), "dynamic with varlen or deterministic"),
                        (dict(varlen=True), "dynamic with varlen or deterministic"),
                        (dict(dq_writer=False), "dynamic without dq_writer"),
                        (dict(stages=3), "at stages > 2"),
                        (dict(dropout=True), "with dropout")):
        assert why in " ".join(dyn.replace(**change).problems()), change
    # for_problem drops it where it does not run (a speed choice), keeps it elsewhere
    assert not FAM.for_problem(dyn, problem(deterministic=True)).dynamic
    assert not FAM.for_problem(dyn, problem(features=("varlen",))).dynamic
    assert FAM.for_problem(dyn, problem()).dynamic and FAM.for_problem(dyn, problem(64, False)).dynamic


def test_dynamic_and_ds_double_heuristic_switches(monkeypatch):
    # dropout's own speed rule (DROPOUT_FAST, session 27) off: this test's dropout rows check the rules before it
    # (test_bwd_feature_sched_cpu.py::test_dropout_alone_takes_dropout_fast checks the rule)
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {})
    # as shipped: d64 and d128 plain calls (d128 with dk_late and frag_pin, session 16)
    for d, causal, det in itertools.product((64, 128), (False, True), (False, True)):
        p = problem(d, causal, det)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg.dynamic == ((d, causal) in sm90_bwd.HEURISTIC_DYNAMIC and not det) and cfg.problems() == []
    assert sm90_bwd.HEURISTIC_DYNAMIC == {(64, False), (64, True), (128, False), (128, True)}
    # (session 19) fp16 d128 causal: the plain grid above 4k, the rest of the heuristic's fields kept
    assert sm90_bwd.DYNAMIC_MAX_SEQLEN_BY == {(128, True, "fp16"): 4096}
    for d, causal, dtype, s in itertools.product((64, 96, 128), (False, True), ("bf16", "fp16"), (4096, 8192)):
        p = Problem("bwd", dtype, 2, s, s, 16, 16, d, causal)
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        plain = d > 64 and causal and dtype == "fp16" and s > 4096
        assert cfg.dynamic == (not plain) and cfg.problems() == [], cfg.name
        assert cfg.dk_late == cfg.dq_early == (d in (64, 96, 128)) and cfg.frag_pin == (d > 64), cfg.name
    d96 = FAM.for_problem(FAM.heuristic(problem(96, True)), problem(96, True))   # the d128 kernel
    assert d96.dk_late and d96.ds_double and d96.dynamic and d96.frag_pin
    assert FAM.for_problem(FAM.heuristic(problem(128, False)), problem(128, False)).dynamic
    # the switches alone (dk_late's d128 choice, which takes the plain grid and ds_double, off)
    monkeypatch.setattr(sm90_bwd, "HEURISTIC_DK_LATE", frozenset())
    for on in (False, True):
        monkeypatch.setattr(sm90_bwd, "HEURISTIC_DYNAMIC",
                            frozenset(itertools.product((64, 128), (False, True))) if on else frozenset())
        monkeypatch.setattr(sm90_bwd, "HEURISTIC_DS_DOUBLE", on)
        for d, causal, det in itertools.product((64, 128), (False, True), (False, True)):
            p = problem(d, causal, det)
            cfg = FAM.for_problem(FAM.heuristic(p), p)
            assert cfg.dynamic == (on and not det) and cfg.ds_double == (on and d == 128)
            assert cfg.problems() == []
        # calls with features keep the plain grid (the dynamic kernels with features are unmeasured),
        # except a window alone: sm90_bwd.WINDOW_BWD's (measured) fields
        for feats in (("dropout",), ("softcap",), ("alibi", "softcap", "window"), ("window",)):
            p = problem(128, True, features=feats, dropout_p=0.1 if "dropout" in feats else 0.0)
            cfg = FAM.for_problem(FAM.heuristic(p), p)
            window_bwd = sm90_bwd.WINDOW_BWD[128] if feats == ("window",) else {}
            assert cfg.problems() == [] and cfg.dynamic == window_bwd.get("dynamic", False)
            assert cfg.ds_double == ((on or window_bwd.get("ds_double", False)) and feats == ("window",))
        assert not FAM.for_problem(FAM.heuristic(problem(64, features=("varlen",))),
                                   problem(64, features=("varlen",))).dynamic


def test_dynamic_plan_grid_and_counter(monkeypatch):
    """A CTA per SM (at most one per tile); the plan's zeroed counter in tile_counter."""
    import numpy as np
    from types import SimpleNamespace

    from cuflash import launch
    from test_sm90_bwd_cpu import fake_launches

    dt, launches = fake_launches(monkeypatch)
    allocs = []

    def zeroed(n, device, what):
        allocs.append((n, what))
        return SimpleNamespace(ptr=0xC0DE00 + len(allocs))

    monkeypatch.setattr(launch, "_zeroed_i32", zeroed)
    monkeypatch.setattr(sm90_bwd, "dq_accum_map", lambda ptr, shape, rows: bytes(128))
    from cuflash.families import sm90_fwd
    monkeypatch.setattr(sm90_fwd, "_encoder", lambda *a: bytes(128))
    monkeypatch.setattr(sm90_fwd, "_MAP_CACHE", {})
    for s, tiles in ((2048, 8 * 16 * 16), (100, 8)):
        p = problem(128, True, batch=2 if s == 100 else 8, seqlen=s, nheads=4 if s == 100 else 16)
        cfg = FAM.for_problem(heur().replace(dynamic=True, lpt=True), p)
        st = fa2_bwd.contiguous_strides(p)
        before = len(allocs)
        plan = launch.Plan(FAM, cfg, p, {n: st for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")}, 0.1, 0)
        main = next(spec for spec in plan.launches if spec.role == "main")
        assert main.grid[0] == min(tiles, 132) and main.smem == cfg.smem_bytes
        launches.clear()
        plan.run(tuple(0x10000 * (i + 1) for i in range(9)), 0x1000000, 7)
        rec = np.frombuffer(launches[1]["raw"], dt)[0]
        # the plan's counters (launch.StreamCounters): the buffer zeroed with the plan goes to the
        # first stream (7), and a new spare is zeroed behind it
        assert int(rec["tile_counter"]) == 0xC0DE00 + before + 1 and len(allocs) == before + 2
    assert [n for n, _ in allocs] == [1, 1, 1, 1] and allocs[0][1] == f"{cfg.name} (tile_counter)"
    # without dynamic: no counter, the field null
    assert FAM.zeroed_counters(heur(), problem()) == {}


@needs_nvcc
def test_dynamic_smem_matches_the_kernel(tmp_path):
    import subprocess

    configs = [heur().replace(dynamic=True), heur(64).replace(dynamic=True, lpt=True),
               heur().replace(dynamic=True, softcap=True)]
    exprs = []
    for c in configs:
        shape = f"cuflash::Sm90BwdShape<{c.BM}, {c.BN}, {c.stages}, {c.consumers}, {c.head_dim}, true>"
        words = f"cuflash::Sm90BwdThreadWords<{shape}, {c.consumers}, {(int(c.softcap) + int(c.dropout)) * c.BM // 4}>"
        stage = f"cuflash::Sm90BwdDqWriterStage<{words}, {c.BM}, {c.head_dim}>"
        exprs += [f"{stage}::kSmemBytes", f"{stage}::kBufs", f"{shape}::kBarEnd % 8"]
    src = tmp_path / "stage.cu"
    src.write_text('#include "sm90_bwd.cu"\n#include <cstdio>\nint main() {\n'
                   + "".join(f'  std::printf("%d\\n", int({e}));\n' for e in exprs) + "}\n")
    exe = tmp_path / "stage"
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-I", str(kernel_dir()), "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == [v for c in configs for v in (c.smem_bytes, c.dq_writer_bufs, 0)]


@needs_nvcc
def test_dynamic_kernels_compile_clean():
    configs = [heur(d, causal).replace(dynamic=True, lpt=causal) for d in (64, 128) for causal in (False, True)]
    configs += [heur(128).replace(dynamic=True, window=True, softcap=True, alibi=True, dtype="fp16"),
                heur(128).replace(dynamic=True, overlap_sdp=True),
                Sm90BwdConfig(64, 128, 2, 2, 64, "bf16", True, dq_writer=True, dynamic=True),
                Sm90BwdConfig(64, 64, 2, 1, 64, "bf16", False, dq_writer=True, dynamic=True)]
    assert all(c.problems() == [] for c in configs)
    assert compile_clean(configs) == []


# ---------------------------------------------------------------------------------------
# two dS buffers (ds_double, kDsDouble)

def test_ds_double_field_name_template_rules_smem():
    plain = heur()
    ds2 = plain.replace(ds_double=True)
    assert ds2.name == plain.name + "_ds2" and ds2.problems() == []
    assert ds2.kernel_name() == plain.kernel_name()[:-1] + ", false, false, false, true>"
    assert ds2.template_args()[18] is True and len(ds2.template_args()) >= 19
    assert FAM.decode(FAM.encode(ds2), "bf16", True) == ds2 and "ds_double" not in FAM.encode(plain)
    assert FAM.space["ds_double"] == (False, True)
    # one more BM x BN 16-bit tile: d128's heuristic tile fills the 227 KB exactly, both staging tiles kept
    assert ds2.smem_bytes == plain.smem_bytes + 64 * 128 * 2 == 227 * 1024 and ds2.dq_writer_bufs == 2
    assert ds2.replace(dynamic=True, lpt=True).problems() == []
    for change in (dict(head_dim=64, BM=128), dict(softcap=True), dict(alibi=True), dict(dropout=True)):
        assert "ds_double at head dim 64" in " ".join(ds2.replace(**change).problems()), change
    assert not FAM.for_problem(heur(64).replace(ds_double=True), problem(64)).ds_double
    assert FAM.for_problem(ds2, problem()).ds_double


@needs_nvcc
def test_ds_double_smem_matches_the_kernel(tmp_path):
    import subprocess

    configs = [heur().replace(ds_double=True), heur(causal=False).replace(ds_double=True, dynamic=True)]
    exprs = []
    for c in configs:
        shape = (f"cuflash::Sm90BwdShape<{c.BM}, {c.BN}, {c.stages}, {c.consumers}, {c.head_dim}, "
                 f"{'true' if c.dynamic else 'false'}, 2>")
        words = f"cuflash::Sm90BwdThreadWords<{shape}, {c.consumers}, 0>"
        stage = f"cuflash::Sm90BwdDqWriterStage<{words}, {c.BM}, {c.head_dim}>"
        exprs += [f"{stage}::kSmemBytes", f"{stage}::kBufs"]
    src = tmp_path / "stage.cu"
    src.write_text('#include "sm90_bwd.cu"\n#include <cstdio>\nint main() {\n'
                   + "".join(f'  std::printf("%d\\n", int({e}));\n' for e in exprs) + "}\n")
    exe = tmp_path / "stage"
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-I", str(kernel_dir()), "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == [v for c in configs for v in (c.smem_bytes, c.dq_writer_bufs)]


@needs_nvcc
def test_ds_double_kernels_compile_clean():
    configs = [heur(128, causal).replace(ds_double=True, dynamic=dyn, lpt=causal and dyn)
               for causal in (False, True) for dyn in (False, True)]
    configs += [heur(128).replace(ds_double=True, dynamic=True, window=True, dtype="fp16"),
                heur(128).replace(ds_double=True, dynamic=True, overlap_sdp=True),
                heur(128).replace(ds_double=True, dq_writer=False)]
    assert all(c.problems() == [] for c in configs)
    assert compile_clean(configs) == []
