"""CPU checks of variable-length batches on the Hopper forward (sm90_fwd built with varlen,
kernels_cu/sm90_fwd.cu kVarlen, kernels_cu/varlen.cuh): selection, config names, the params of a
varlen plan and the tensor maps over the packed tensors (a fake encoder, no driver), and the
varlen instantiations compiled by nvcc for sm_90a with zero spills and no "wgmma serialized"
warning. The GPU side: tests/test_sm90_varlen_gpu.py.
"""
import ctypes
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _gpu, launch, registry, varlen
from cuflash.families import sm90_fwd
from cuflash.families.fa2_fwd import FwdConfig
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem
from cuflash.select import choose

FAM = registry.get("sm90_fwd")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def vproblem(d=128, causal=True, feats=(), dtype="bf16", nseq=3, max_q=1000, max_k=1200, h=4, hkv=2):
    return Problem("fwd", dtype, nseq, max_q, max_k, h, hkv, d, causal, False,
                   tuple(sorted(feats + ("varlen",))),
                   dropout_p=0.1 if "dropout" in feats else 0.0,
                   window=(64, 0) if "window" in feats else (-1, -1),
                   softcap=30.0 if "softcap" in feats else 0.0)


def test_selection_runs_varlen_on_sm90(monkeypatch):
    fam, cfg, source = choose(vproblem(), (9, 0))
    assert fam.name == "sm90_fwd" and cfg.varlen and source.startswith("heuristic")
    assert cfg.name.endswith("_varlen") and cfg.persistent == sm90_fwd.VARLEN_PERSISTENT
    # sm_80: fa2_fwd's varlen build, as before
    fam, cfg, _ = choose(vproblem(), (8, 0))
    assert fam.name == "fa2_fwd" and cfg.varlen
    # the plain heuristic's tiles (varlen changes the schedule only)
    # (the static tiles: varlen runs neither the dynamic scheduler nor the TMA-store epilogue)
    monkeypatch.setattr(sm90_fwd, "HEURISTIC_DYNAMIC", False)
    plain = FAM.heuristic(vproblem().replace(features=()), (9, 0))
    assert FAM.heuristic(vproblem(), (9, 0)).replace(persistent=plain.persistent) == plain


def test_config_forces_either_family():
    p = vproblem(64, False)
    fam, cfg, src = choose(p, (9, 0), config=FwdConfig(128, 64, 4, 2, 64, "bf16", False))
    assert fam.name == "fa2_fwd" and cfg.varlen and src == "given"
    fam, cfg, _ = choose(p, (9, 0), config=Sm90FwdConfig(128, 128, 2, 2, True, True, 64, "bf16", False))
    assert fam.name == "sm90_fwd" and cfg.varlen and cfg.persistent
    # and a fixed-length call given a varlen config runs the plain kernel
    fam, cfg, _ = choose(p.replace(features=()), (9, 0),
                         config=Sm90FwdConfig(128, 128, 2, 2, True, False, 64, "bf16", False, varlen=True))
    assert not cfg.varlen


def test_names_and_encoding():
    cfg = Sm90FwdConfig(128, 176, 2, 2, True, False, 128, "bf16", True)
    assert cfg.kernel_name() == ("cuflash::sm90_fwd<128, 176, 2, 2, true, false, 128, cuflash::bf16, "
                                 "true, false, false, false>")   # plain: unchanged
    v = cfg.replace(varlen=True)
    assert v.kernel_name() == ("cuflash::sm90_fwd<128, 176, 2, 2, true, false, 128, cuflash::bf16, "
                               "true, false, false, false, false, 0, false, false, true>")
    assert v.name == cfg.name + "_varlen"
    args = dict(zip(type(v).__dataclass_fields__, v.template_args()))   # (the feature variants after it)
    assert args["varlen"] is True and len(v.template_args()) == len(type(v).__dataclass_fields__) - 3   # (section: run time; cluster: the entry point; even_waves: the grid)
    drop = cfg.replace(dropout=True, varlen=True, BN=128)
    assert drop.kernel_name().endswith("false, false, false, true, 0, false, false, true>")
    # varlen is the call's, not encoded (a tuned entry or a torch-op config string never carries it)
    assert FAM.encode(v) == FAM.encode(cfg) and "varlen" not in FAM.encode(v)
    assert not FAM.decode(FAM.encode(v), "bf16", True).varlen


def test_supports_and_fallbacks():
    assert FAM.supports((9, 0), vproblem()) == ""
    for feats in sm90_fwd.VARLEN_FEATURES:
        assert FAM.supports((9, 0), vproblem(feats=feats)) == "", feats
    # a paged cache: fa2_fwd_paged; an unchecked mix: fa2_fwd
    assert "paged" in FAM.supports((9, 0), vproblem(feats=("paged",)))
    unchecked = [f for f in (("alibi", "dropout"), ("dropout", "softcap"), ("alibi", "softcap", "window"))
                 if f not in sm90_fwd.VARLEN_FEATURES]
    for feats in unchecked:
        why = FAM.supports((9, 0), vproblem(feats=feats))
        assert why and "sm90_fwd has no feature" in why, feats
        assert choose(vproblem(feats=feats), (9, 0))[0].name == "fa2_fwd"
    # softcap with dropout at d128: varlen runs here (its varlen build checked, timed), fixed lengths on fa2_fwd
    p = vproblem(128, feats=("dropout", "softcap"))
    assert FAM.supports((9, 0), p) == "" and choose(p, (9, 0))[0].name == "sm90_fwd"
    assert "with dropout" in FAM.supports((9, 0), p.replace(features=("dropout", "softcap")))
    assert "with dropout" in FAM.supports((9, 0), vproblem(96, feats=("dropout", "softcap")))   # (d96: unchecked)


def test_launch_grid_is_sized_for_the_longest_sequence():
    p = vproblem(nseq=5, max_q=300, h=8)
    cfg = FAM.for_problem(FAM.heuristic(p), p)
    assert FAM.launches(cfg, p, 132)[0].grid == (-(-300 // cfg.BM) * 8 * 5, 1, 1)
    assert FAM.launches(cfg.replace(persistent=True), p, 132)[0].grid == (min(132, 3 * 8 * 5), 1, 1)


def test_map_shapes_span_the_packed_tensors():
    p = vproblem(d=72, nseq=3, h=8, hkv=2)
    shapes = sm90_fwd.map_shapes(p, {"totals": (700, 1500)})
    assert shapes == {"q": (1, 700, 8, 72), "k": (1, 1500, 2, 72), "v": (1, 1500, 2, 72)}
    assert sm90_fwd.map_shapes(p.replace(features=()), {})["q"] == (3, 1000, 8, 72)
    # a packed (total, heads, d) view as the varlen paths pass it (strides4: batch stride 0), and
    # a qkv-packed one (the caller's row and head strides)
    args = sm90_fwd.tensor_map_args("bf16", 0x1000, shapes["q"], varlen.strides4((8 * 72, 72, 1)), 128)
    assert args[2] == (72, 700, 8, 1) and args[3] == (2 * 8 * 72, 2 * 72, 16) and args[4] == (64, 128, 1, 1)
    args = sm90_fwd.tensor_map_args("fp16", 0x2000, (1, 700, 8, 64), varlen.strides4((3 * 8 * 64, 64, 1)), 176)
    assert args[3] == (2 * 3 * 8 * 64, 2 * 64, 16) and args[4][1] == 176


@pytest.fixture
def fake_driver(monkeypatch):
    """(encoder calls, launches, [bytes of the params struct each launch records])."""
    calls, launches = [], []
    size = [launch.struct_dtype("Sm90FwdParams").itemsize]

    def encode(*args):
        calls.append(args)
        return bytes((len(calls) + i) % 256 for i in range(128))

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(dict(fn=fn, grid=(gx, gy, gz), raw=ctypes.string_at(ptr, size[0])))

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    monkeypatch.setattr(sm90_fwd, "_MAP_CACHE", {})
    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {
        role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i))
        for i, role in enumerate(("main", "preprocess", "convert_dq", "reduce_dkv"))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    return calls, launches, size


@pytest.mark.parametrize("route", ["run_varlen", "run_features"])
def test_varlen_plan_writes_maps_and_cu_seqlens(fake_driver, route):
    calls, launches, _ = fake_driver
    p = vproblem(d=64, causal=False, nseq=3, max_q=500, max_k=600, h=4, hkv=2)
    cfg = FAM.for_problem(FAM.heuristic(p), p)
    q3, k3 = (4 * 64, 64, 1), (2 * 64, 64, 1)
    full = {n: varlen.strides4(s) for n, s in (("q", q3), ("k", k3), ("v", k3), ("o", q3))}
    full["totals"] = (900, 1100)
    plan = launch.Plan(FAM, cfg, p, full, 0.125, 0)
    dt = launch.struct_dtype("Sm90FwdParams")
    ptrs = (0x10000, 0x20000, 0x30000, 0x40000, 0x50000)
    if route == "run_varlen":
        plan.run_varlen(ptrs, 0, 7, 0x60000, 0x70000)
    else:
        varlen.run_features(plan, ptrs, 0, 7, 0x60000, 0x70000)
    (call,) = launches
    rec = np.frombuffer(call["raw"], dt)[0]
    assert tuple(int(rec[n]) for n in FAM.pointer_fields) == ptrs
    assert int(rec["cu_seqlens_q"]) == 0x60000 and int(rec["cu_seqlens_k"]) == 0x70000
    assert rec["total_q"] == 900 and rec["batch"] == 3 and rec["seqlen_q"] == 500 and rec["seqlen_k"] == 600
    assert rec["o_batch_stride"] == 0 and rec["o_row_stride"] == 4 * 64
    assert [a[2] for a in calls] == [(64, 900, 4, 1), (64, 1100, 2, 1), (64, 1100, 2, 1)]
    for i, field in enumerate(("tma_q", "tma_k", "tma_v")):   # the maps were written, not zeros
        off = dt.fields[field][1]
        assert call["raw"][off:off + 128] == bytes((i + 1 + j) % 256 for j in range(128)), field
    assert call["grid"] == (-(-500 // cfg.BM) * 4 * 3, 1, 1)


def test_fixed_length_params_carry_no_varlen_fields(fake_driver):
    p = vproblem().replace(features=())
    st = (1000 * 4 * 128, 4 * 128, 128, 1)
    kst = (1200 * 2 * 128, 2 * 128, 128, 1)
    static = FAM.static_params(FAM.heuristic(p), p, {"q": st, "k": kst, "v": kst, "o": st}, {}, 0.1, 132)
    assert static["total_q"] == 0 and static["cu_seqlens_q"] == 0 and static["cu_seqlens_k"] == 0


# ---------------------------------------------------------------------------------------
# nvcc: the varlen instantiations selection builds compile without spills

def varlen_configs():
    """The heuristic's varlen configs: head dims 64, 96, 128, 192, 256 (dtype and causal rotate),
    and every feature set of VARLEN_FEATURES that supports() takes at d64 and d128, causal and not."""
    out = []
    for i, d in enumerate((64, 96, 128, 192, 256)):
        p = vproblem(d, causal=bool(i % 2), dtype=("bf16", "fp16")[i % 2])
        out.append(FAM.for_problem(FAM.heuristic(p), p))
    for feats in sm90_fwd.VARLEN_FEATURES:
        for d, causal in ((64, False), (64, True), (128, False), (128, True)) if feats else ():
            p = vproblem(d, causal=causal, feats=feats)
            if not FAM.supports((9, 0), p):
                out.append(FAM.for_problem(FAM.heuristic(p), p))
    return out


def nvcc_reports(configs):
    """ptxas's reports of ``configs`` on sm_90a, 4 configs per nvcc run, 2 runs at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    chunks = [configs[i:i + 4] for i in range(0, len(configs), 4)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a"), chunks) for r in rs]


@needs_nvcc
def test_varlen_instantiations_compile_without_spills():
    configs = varlen_configs()
    assert all(c.varlen for c in configs)
    for cfg, rep in zip(configs, nvcc_reports(configs)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, f"{cfg.name}: spills ({rep})"
        serialized = [w for w in rep.warnings if any(f"C751{i}" in w for i in range(0, 6))]
        assert not serialized, f"{cfg.name}: {serialized}"


# ---------------------------------------------------------------------------------------
# sm90_bwd varlen (sm90_bwd.VARLEN_BWD: on by default since the H100 round)

from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402

BWD = registry.get("sm90_bwd")


def bproblem(d=128, causal=True, det=False, feats=(), nseq=3, h=4, hkv=2):
    return vproblem(d, causal, feats, nseq=nseq, h=h, hkv=hkv).replace(op="bwd", deterministic=det)


@pytest.fixture
def varlen_bwd_on(monkeypatch):
    monkeypatch.setattr(sm90_bwd, "VARLEN_BWD", True)


def test_bwd_varlen_switch(monkeypatch):
    monkeypatch.setattr(sm90_bwd, "VARLEN_BWD", False)     # CUFLASH_SM90_VARLEN_BWD=0
    assert BWD.supports((9, 0), bproblem()) == "sm90_bwd has no feature 'varlen'"
    assert choose(bproblem(), (9, 0))[0].name == "fa2_bwd"
    monkeypatch.setattr(sm90_bwd, "VARLEN_BWD", True)      # the default
    assert "varlen" in BWD.features and choose(bproblem(), (9, 0))[0].name == "sm90_bwd"


def test_bwd_varlen_selection_and_names(varlen_bwd_on):
    fam, cfg, _ = choose(bproblem(128), (9, 0))
    assert fam.name == "sm90_bwd" and cfg.varlen and cfg.name.endswith("_varlen")
    assert choose(bproblem(64), (9, 0))[0].name == "sm90_bwd"         # rank(): VARLEN_SMALL_D {64, 96}
    assert choose(bproblem(96), (9, 0))[0].name == "sm90_bwd"
    assert choose(bproblem(64, feats=("window",)), (9, 0))[0].name == "sm90_bwd"   # (VARLEN_SMALL_D_FEATURES)
    assert choose(bproblem(64, feats=("dropout",)), (9, 0))[0].name == "fa2_bwd"   # (dropout: fa2_bwd)
    assert "deterministic varlen" in BWD.supports((9, 0), bproblem(128, det=True))
    assert BWD.supports((9, 0), bproblem(64, det=True)) == ""
    for feats in (("window",), ("dropout",), ("alibi", "softcap")):
        if feats not in sm90_bwd.VARLEN_FEATURES:
            assert "with varlen" in BWD.supports((9, 0), bproblem(feats=feats))
    plain = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, dq_writer=True)
    v = plain.replace(varlen=True)
    assert v.kernel_name() == plain.kernel_name()[:-1] + ", true>"
    assert len(v.template_args()) >= 19 and v.template_args()[15] is True   # (kLpt, kDynamic, kDsDouble last)
    assert BWD.encode(v) == BWD.encode(plain)
    names = BWD.kernel_names(v)
    assert names["preprocess"] == "cuflash::fa2_bwd_preprocess<cuflash::bf16, true>"
    assert names["convert_dq"].endswith("<cuflash::bf16, true>")
    assert BWD.kernel_names(plain)["preprocess"] == "cuflash::fa2_bwd_preprocess<cuflash::bf16>"


def test_bwd_varlen_plan_maps_and_workspace(fake_driver, varlen_bwd_on):
    calls, launches, size = fake_driver
    size[0] = launch.struct_dtype("Sm90BwdParams").itemsize
    p = bproblem(128, causal=False, nseq=3, h=4, hkv=2).replace(seqlen_q=500, seqlen_k=600)
    cfg = BWD.for_problem(BWD.heuristic(p), p)
    assert cfg.dq_writer and cfg.varlen
    q3, k3 = (4 * 128, 128, 1), (2 * 128, 128, 1)
    strides = {n: varlen.strides4(s) for n, s in (("dout", q3), ("q", q3), ("k", k3), ("v", k3), ("o", q3),
                                                  ("dq", q3), ("dk", k3), ("dv", k3))}
    strides["totals"] = (900, 1100)
    plan = launch.Plan(BWD, cfg, p, strides, 0.125, 0)
    ws = BWD.workspace(cfg, p, strides)
    rows = (900 + 136 * 3 + 7) // 8 * 8
    assert ws["D"] - ws["lse_log2"] >= 4 * rows * 4
    ptrs = tuple(0x10000 * (i + 1) for i in range(9))
    plan.run_varlen(ptrs, 0x900000, 7, 0x60000, 0x70000)
    dt = launch.struct_dtype("Sm90BwdParams")
    main = next(c for c in launches if c["fn"] == 1000)
    rec = np.frombuffer(main["raw"], dt)[0]
    assert int(rec["cu_seqlens_q"]) == 0x60000 and int(rec["cu_seqlens_k"]) == 0x70000
    assert rec["ws_rows"] == rows and rec["total_q"] == 900 and rec["total_k"] == 1100
    assert rec["q_batch_stride"] == 0 and rec["dk_batch_stride"] == 0
    # q, k, v, dO over the packed tensors, then the dQ accumulator's (head_dim, ws_rows, nheads)
    assert [a[2] for a in calls[:4]] == [(128, 900, 4, 1), (128, 1100, 2, 1), (128, 1100, 2, 1), (128, 900, 4, 1)]
    assert calls[4][1] == 0x900000 + ws["dq_accum"] and calls[4][2] == (128, rows, 4)
    assert main["grid"] == (3 * 4 * -(-600 // cfg.BN), 1, 1)


def varlen_bwd_configs():
    """sm90_bwd's varlen heuristic configs: d64 and d128, causal and not, deterministic at d64,
    and every feature set of VARLEN_FEATURES that supports() takes at d64 and d128, causal and not
    (deterministic at d64 too)."""
    out = []
    for d, causal, det in ((64, True, False), (64, False, True), (128, True, False), (128, False, False)):
        p = bproblem(d, causal, det)
        out.append(BWD.for_problem(BWD.heuristic(p), p))
    for feats in sm90_bwd.VARLEN_FEATURES:
        for d, causal, det in ((64, False, False), (64, True, False), (64, True, True), (128, False, False),
                               (128, True, False)):
            p = bproblem(d, causal, det, feats=feats)
            if feats and not BWD.supports((9, 0), p):
                out.append(BWD.for_problem(BWD.heuristic(p), p))
    return out


@needs_nvcc
def test_varlen_bwd_instantiations_compile_without_spills():
    configs = varlen_bwd_configs()
    assert all(c.varlen for c in configs)
    for cfg, rep in zip(configs, nvcc_reports(configs)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0, f"{cfg.name}: spills ({rep})"
        serialized = [w for w in rep.warnings if any(f"C751{i}" in w for i in range(0, 6))]
        assert not serialized, f"{cfg.name}: {serialized}"
