"""CPU checks of the Hopper backward family sm90_bwd (cuflash/families/sm90_bwd.py,
kernels_cu/sm90_bwd.cu): config rules and space, supports() and selection (below fa2_bwd,
forced by config), the params struct (BwdParams as an exact prefix, then four tensor maps),
the launch plan with its per-call tensor maps (fake encoder), and the nvcc/ptxas build of
every valid point of the space (no spills, no "wgmma ... serialized" warnings). No GPU needed.
"""
import ctypes
import itertools
import os
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _gpu, launch, registry
from cuflash.compile import kernel_dir, kernel_param_decl, nvcc_compile
from cuflash.families import fa2_fwd, sm90_bwd, sm90_fwd
from cuflash.families.base import ConfigError
from cuflash.families.sm90_bwd import HEAD_DIMS, Sm90BwdConfig
from cuflash.problem import DTYPES, Problem
from cuflash.select import choose

from test_sm90_cpu import serialized  # noqa: E402

NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
FAM = registry.get("sm90_bwd")


def problem(head_dim=64, dtype="bf16", causal=False, deterministic=False, **kw):
    shape = dict(batch=2, seqlen_q=300, seqlen_k=200, nheads=8, nheads_kv=2)
    shape.update(kw)
    return Problem("bwd", dtype, shape["batch"], shape["seqlen_q"], shape["seqlen_k"],
                   shape["nheads"], shape["nheads_kv"], head_dim, causal, deterministic)


def sched(config):
    """Whether a config uses the schedule flags overlap_sdp / dq_writer (appended after dq_bulk;
    tests/test_sm90_bwd_sched_cpu.py covers them, the tests here the configs without) or the launch
    order lpt (tests/test_sm90_bwd_causal_cpu.py), or the main-loop flags dq_early / s_ahead / q_rotate
    / frag_pin (tests/test_sm90_bwd_d128_cpu.py)."""
    return (config.overlap_sdp or config.dq_writer or config.lpt or config.dynamic or config.ds_double
            or config.dq_early or config.s_ahead or config.q_rotate or config.frag_pin)


# ---------------------------------------------------------------------------------------
# config rules, space, heuristic, selection

def test_good_configs_and_names():
    cfg = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True)
    assert cfg.problems() == [] and cfg.warps == 12 and cfg.threads == 384
    assert cfg.name == "sm90bwd_bf16_d128_causal_BM64_BN128_s2_c2"
    assert cfg.replace(deterministic=True).name.endswith("_det")
    assert cfg.dq_cols == 64 and cfg.accum_regs == 256
    assert cfg.kernel_name() == "cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, true, false>"
    # K, V 32 KB each; 2 x (Q, dO) 16 KB each; dS 16 KB; LSE, D; barriers; alignment
    assert cfg.smem_bytes == 2 * 32768 + 4 * 16384 + 16384 + 4 * 256 + 8 * 5 + 1024
    assert Sm90BwdConfig(64, 64, 2, 1, 64, "fp16", False).problems() == []


@pytest.mark.parametrize("change,pattern", [
    (dict(head_dim=96), "head_dim must be one of"),
    (dict(consumers=3, BN=192), "consumers must be 1 or 2"),
    (dict(BN=64), "shared keys\\) is the head_dim=256 tile"),
    (dict(BN=128, consumers=1), "BN=128 must be 64 \\* consumers"),
    (dict(head_dim=256), "head_dim=256 takes BN=64 with consumers=2"),
    (dict(BM=96), "BM must be 64 or 128"),
    (dict(BM=128, BN=64, consumers=1), "BM / 64 must divide consumers"),
    (dict(stages=1), "stages must be >= 2"),
    (dict(BM=128), "more than the 232448"),
    (dict(BM=128, head_dim=64, dropout=True), "dropout with BM=128"),
    (dict(head_dim=64, dropout=True, dq_bulk=True), "dq_bulk with dropout and 2 consumers"),
    (dict(BN=64, consumers=1), "exceed the budget"),
])
def test_each_rule(change, pattern):
    cfg = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False).replace(**change)
    with pytest.raises(ConfigError, match=pattern):
        cfg.validate()


def test_space_and_heuristic():
    fa2 = registry.get("fa2_bwd")
    assert FAM.rank(problem(128)) > fa2.rank(problem(128)) and FAM.rank(problem(104)) > fa2.rank(problem(104))
    # head dims <= 96 too, as measured (D64_ABOVE_FA2, D96_ABOVE_FA2)
    assert FAM.rank(problem(96)) > fa2.rank(problem(96))
    assert FAM.rank(problem(64)) > fa2.rank(problem(64))
    valid = {d: sorted((c.BM, c.BN, c.stages, c.consumers) for c in FAM.valid(problem(d), 227 * 1024)
                       if not c.dq_bulk and not sched(c))
             for d in HEAD_DIMS}
    assert valid == {64: [(64, 64, 2, 1), (64, 64, 3, 1), (64, 128, 2, 2), (64, 128, 3, 2),
                          (128, 128, 2, 2), (128, 128, 3, 2)],
                     128: [(64, 128, 2, 2), (64, 128, 3, 2)], 256: [(64, 64, 2, 2)]}
    for d in range(8, 257, 8):
        for dtype, causal, det in itertools.product(DTYPES, (False, True), (False, True)):
            p = problem(d, dtype, causal, det)
            assert FAM.supports((9, 0), p) == ""
            cfg = FAM.for_problem(FAM.heuristic(p), p)
            assert cfg.problems(227 * 1024) == [] and cfg.head_dim == FAM.head_dim_of(d) >= d
            assert cfg.deterministic == det and FAM.fits(cfg, p) == ""


def test_supports_and_selection():
    assert "headdim must be a multiple of 8 in 8..256" in FAM.supports((9, 0), problem(264))
    assert FAM.supports((9, 0), problem(136)) == "" and FAM.supports((9, 0), problem(256)) == ""
    # varlen runs here too (tests/test_sm90_varlen_cpu.py), with the feature mixes VARLEN_FEATURES lists
    assert FAM.supports((9, 0), problem(64).replace(features=("varlen",))) == ""
    assert FAM.supports((9, 0), problem(64).replace(features=("alibi", "varlen", "window"))) == ""   # (session 25)
    assert "deterministic varlen" in FAM.supports((9, 0), problem(128).replace(
        features=("alibi", "varlen", "window"), deterministic=True))
    assert FAM.supports((8, 0), problem(64)).startswith("sm90_bwd needs sm_90")
    assert FAM.supports((10, 0), problem(64)).startswith("sm90_bwd needs sm_90 exactly")
    assert "implements op 'bwd', not 'fwd'" in FAM.supports((9, 0), problem(64).replace(op="fwd"))
    p = problem(128)
    assert choose(p, (9, 0))[0].name == "sm90_bwd"                     # the default at d 97..128
    assert choose(problem(64), (9, 0))[0].name == "sm90_bwd"           # and at d <= 96 (measured)
    assert choose(p, (8, 0))[0].name == "fa2_bwd"                      # and everywhere off sm_90
    # window / softcap / ALiBi keep the plain rule
    windowed = p.replace(features=("window",), window=(8, 0))
    assert choose(windowed, (9, 0))[0].name == "sm90_bwd"
    assert choose(windowed.replace(head_dim=64), (9, 0))[0].name == "sm90_bwd"
    # dropout: the same rule (DROPOUT_BY_DEFAULT, on since its GPU tests passed)
    assert choose(p.replace(features=("dropout",), dropout_p=0.1), (9, 0))[0].name == "sm90_bwd"
    forced = fa2 = registry.get("fa2_bwd").heuristic(p)
    assert choose(p, (9, 0), config=fa2)[0].name == "fa2_bwd"           # config= forces fa2_bwd
    forced = FAM.heuristic(p)
    fam, cfg, _ = choose(p, (9, 0), config=forced)
    assert fam is FAM and cfg == forced                                 # config= forces it
    # d129..192: the d256 kernel (D192_ABOVE_FA2, measured), fa2_bwd with the switch off
    assert choose(problem(192), (9, 0))[0].name == ("sm90_bwd" if sm90_bwd.D192_ABOVE_FA2 else "fa2_bwd")
    assert FAM.decode(FAM.encode(forced), "bf16", False) == forced


# ---------------------------------------------------------------------------------------
# features: sliding window, softcap, ALiBi (compile-time flags appended to the template)

FLAG_SETS = [("window",), ("softcap",), ("alibi",), ("alibi", "softcap", "window")]


def test_feature_flags_names_and_template():
    # varlen while sm90_bwd.VARLEN_BWD is on (the default; CUFLASH_SM90_VARLEN_BWD=0 turns it off)
    varlen = ("varlen",) if "varlen" in FAM.features else ()
    assert FAM.features == ("alibi", "dropout", "softcap") + varlen + ("window",)
    plain = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True)
    # the plain config keeps its name and name expression (a feature-free kernel is unchanged)
    assert plain.template_args()[15:19] == (False, False, False, False)
    cfg = plain.replace(window=True, softcap=True, alibi=True)
    assert cfg.name == plain.name + "_win_cap_alibi"
    assert plain.replace(softcap=True).name.endswith("_c2_cap") and plain.replace(alibi=True).name.endswith("_alibi")
    assert cfg.replace(deterministic=True).name.endswith("_det_win_cap_alibi")
    assert cfg.kernel_name() == ("cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, true, false, "
                                 "true, true, true>")
    assert plain.replace(alibi=True).kernel_name().endswith("true, false, false, false, true>")
    assert cfg.template_args()[:19] == (64, 128, 2, 2, 128, "bf16", True, False, True, True, True, False, False, False,
                                        False, False, False, False, False)   # ..., kDqWriter, kVarlen, kLpt, kDynamic, kDsDouble
    drop = plain.replace(dropout=True)
    assert drop.name == plain.name + "_drop" and drop.replace(deterministic=True).name.endswith("_det_drop")
    assert drop.kernel_name().endswith("true, false, false, false, false, true>")
    assert drop.template_args()[8:19] == (False, False, False, True, False, False, False, False, False, False, False)
    # softcap keeps 1 - tanh² in shared memory past the mbarriers (Sm90BwdThreadWords): 16-byte aligned,
    # BM / 2 16-bit values per consumer thread
    used = plain.smem_bytes - 1024
    assert plain.replace(softcap=True).smem_bytes == -(-used // 16) * 16 + 64 // 16 * 16 * 256 + 1024
    assert plain.replace(window=True, alibi=True).smem_bytes == plain.smem_bytes
    # dropout: the signed Pᵀ, as many words again
    assert drop.smem_bytes == plain.replace(softcap=True).smem_bytes
    assert drop.replace(softcap=True).smem_bytes == -(-used // 16) * 16 + 2 * 64 // 16 * 16 * 256 + 1024
    assert FAM.decode(FAM.encode(cfg), "bf16", True) == plain   # flags are not encoded: the call's


@pytest.mark.parametrize("feats", FLAG_SETS, ids="_".join)
def test_features_supported_and_set_by_the_call(feats):
    for d, causal, det in itertools.product(HEAD_DIMS, (False, True), (False, True)):
        p = problem(d, "bf16", causal, det).replace(features=feats, window=(100, 3), softcap=20.0)
        assert FAM.supports((9, 0), p) == ""
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert (cfg.window, cfg.softcap, cfg.alibi) == tuple(f in feats for f in ("window", "softcap", "alibi"))
        assert cfg.deterministic == det and cfg.problems(227 * 1024) == [] and FAM.fits(cfg, p) == ""
        # an explicit plain config gets the call's flags too
        fam, got, source = choose(p, (9, 0), config=FAM.heuristic(p.replace(features=())))
        # (but not the window heuristic's own schedule fields, sm90_bwd.WINDOW_BWD, nor ds_double:
        # a speed choice the heuristic makes for plain d128 calls with dk_late; kept where the
        # call's features allow it)
        own = dict(sm90_bwd.WINDOW_BWD.get(FAM.head_dim_of(d), {})) if feats == ("window",) and not det else {}
        own["ds_double"] = True
        own["frag_pin"] = own["dynamic"] = True   # (d128 plain calls: dk_late with the dynamic scheduler)
        # (and the plain schedule fields, which a given config keeps where sm90_bwd.FEATURE_SCHED_BUILT
        # lists the feature set: tests/test_bwd_feature_sched_cpu.py)
        own["dq_early"] = own["dk_late"] = True
        # (and, with a window alone, a given config's dq_first, wide_epi and dq_convert: session 21; dq_tail: 31)
        if feats == ("window",):
            own["dq_first"] = own["wide_epi"] = own["dq_convert"] = own["dq_tail"] = True
        # (and, with softcap alone, the heuristic's folded step with wide_epi: SOFTCAP_CAP_FOLD, session 23)
        if feats == ("softcap",):
            own["cap_fold"] = own["wide_epi"] = True
        assert fam is FAM and source == "given" and got.replace(**{k: getattr(cfg, k) for k in own}) == cfg
        # with dropout: run where it compiles without spills (not deterministic, no window with
        # softcap / ALiBi at d128: dropout_dq_path, tests/test_dropmix_cpu.py), else refused by
        # name; varlen: the feature sets of VARLEN_FEATURES, not deterministic above d64
        # (tests/test_sm90_varlen_cpu.py)
        mixed = p.replace(features=tuple(sorted(feats + ("dropout",))), dropout_p=0.1)
        refused = det or (d == 128 and "window" in feats and ("softcap" in feats or "alibi" in feats)) \
            or d == 256   # d256: dropout runs alone (its mixes spill)
        why = FAM.supports((9, 0), mixed)
        assert why.startswith(f"sm90_bwd has no feature {sorted(feats)[0]!r} with dropout") \
            if refused else why == "", (d, causal, det, why)
        why = FAM.supports((9, 0), p.replace(features=tuple(sorted(feats + ("varlen",)))))
        ok = tuple(sorted(feats)) in sm90_bwd.VARLEN_FEATURES and not (det and d == 128)
        assert (why == "") == ok and (ok or "varlen" in why), (feats, d, det, why)
    # selection: sm90_bwd at head dims 97..128 (rank), as without the features
    assert choose(problem(128).replace(features=feats), (9, 0))[0].name == "sm90_bwd"
    assert choose(problem(96).replace(features=feats), (9, 0))[0].name == "sm90_bwd"


def test_dropout_config_and_guards(monkeypatch):
    from cuflash.families import sm90_bwd

    for d, det in itertools.product((64, 128), (False, True)):
        p = problem(d, "bf16", True, det).replace(features=("dropout",), dropout_p=0.1)
        if det and d == 128:   # its kernel spills (nvcc 13.0): fa2_bwd runs it
            assert "no deterministic dropout at head dims 65..128" in FAM.supports((9, 0), p)
            with pytest.raises(ConfigError, match="dropout with deterministic"):
                Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", True, True, dropout=True).validate()
            continue
        assert FAM.supports((9, 0), p) == ""
        cfg = FAM.for_problem(FAM.heuristic(p), p)
        assert cfg.dropout and not (cfg.window or cfg.softcap or cfg.alibi) and cfg.problems(227 * 1024) == []
        fam, got, _ = choose(p, (9, 0), config=FAM.heuristic(p.replace(features=())))
        assert fam is FAM and got == cfg
    p = problem(128).replace(features=("dropout",), dropout_p=0.1)
    monkeypatch.setattr(sm90_bwd, "DROPOUT_BY_DEFAULT", False)
    assert FAM.rank(p) < registry.get("fa2_bwd").rank(p)               # the switch off: fa2_bwd
    monkeypatch.setattr(sm90_bwd, "DROPOUT_BY_DEFAULT", True)
    assert choose(p, (9, 0))[0].name == "sm90_bwd"
    assert choose(p.replace(head_dim=64), (9, 0))[0].name == "sm90_bwd"


def fake_launches(monkeypatch):
    """Launches recorded instead of run (no GPU): the plan's kernels by role, 132 SMs, and each
    launch's function, grid, block, shared memory and packed Sm90BwdParams bytes appended to the
    returned list. Returns (the params dtype, that list)."""
    dt = launch.struct_dtype("Sm90BwdParams")
    launches = []

    def record(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        ptr = ctypes.c_uint64.from_address(argv).value
        launches.append(dict(fn=fn, grid=(gx, gy, gz), block=bx, smem=smem,
                             raw=ctypes.string_at(ptr, dt.itemsize)))

    roles = ("main", "preprocess", "convert_dq", "reduce_dkv")
    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {
        r: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i)) for i, r in enumerate(roles)})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: record)
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    return dt, launches


def test_feature_params_reach_the_struct(monkeypatch, fake_encoder):
    """window bounds, softcap factors and the ALiBi batch stride land in the packed Sm90BwdParams
    (BwdParams' fields), the slopes' address per call through run_fields."""
    # dropout's own speed rule (DROPOUT_FAST, session 27) off: this test's dropout rows check the rules before it
    # (test_bwd_feature_sched_cpu.py::test_dropout_alone_takes_dropout_fast checks the rule)
    monkeypatch.setattr(sm90_bwd, "DROPOUT_FAST", {})
    dt, launches = fake_launches(monkeypatch)
    p = problem(128, "bf16", False).replace(features=("alibi", "softcap", "window"), window=(40, 7),
                                            softcap=25.0, alibi_batched=True)
    cfg = FAM.for_problem(FAM.heuristic(p), p)
    assert cfg.window and cfg.softcap and cfg.alibi
    q_st, k_st = (300 * 8 * 128, 8 * 128, 128, 1), (200 * 2 * 128, 2 * 128, 128, 1)
    strides = {"dout": q_st, "q": q_st, "k": k_st, "v": k_st, "o": q_st, "dq": q_st, "dk": k_st, "dv": k_st}
    plan = launch.Plan(FAM, cfg, p, strides, 0.125, 0)
    plan.run_fields({"alibi_slopes": 0xABC000}, tuple(0x10000 * (i + 1) for i in range(9)), 0x1000000, 7)
    main = launches[1]
    rec = np.frombuffer(main["raw"], dt)[0]
    assert main["fn"] == 1000 and main["smem"] == cfg.smem_bytes
    assert (int(rec["window_left"]), int(rec["window_right"])) == (40, 7)
    assert rec["softcap_in"] == np.float32(0.125 / 25.0) and rec["softcap_out"] == np.float32(25.0 / 0.125)
    assert int(rec["alibi_slopes"]) == 0xABC000 and int(rec["alibi_batch_stride"]) == 8
    # dropout: threshold and scale (the rng state's address is written per call, run_with)
    launches.clear()
    p = problem(128, "bf16", True).replace(features=("dropout",), dropout_p=0.25)
    cfg = FAM.for_problem(FAM.heuristic(p), p)
    plan = launch.Plan(FAM, cfg, p, strides, 0.125, 0)
    plan.run_with(tuple(0x10000 * (i + 1) for i in range(9)), 0x1000000, 7, (("rng_state", 0xDEF000),))
    rec = np.frombuffer(launches[1]["raw"], dt)[0]
    assert launches[1]["smem"] == cfg.smem_bytes and cfg.dropout
    assert int(rec["dropout_threshold"]) == 64 and rec["dropout_scale"] == np.float32(1 / 0.75)
    assert int(rec["rng_state"]) == 0xDEF000


# ---------------------------------------------------------------------------------------
# the params struct and the plan

def test_params_struct_has_bwdparams_as_prefix():
    ours, theirs = launch.struct_dtype("Sm90BwdParams"), launch.struct_dtype("BwdParams")
    assert ours.names[:len(theirs.names)] == theirs.names
    assert all(ours.fields[n][1] == theirs.fields[n][1] and ours.fields[n][0] == theirs.fields[n][0]
               for n in theirs.names)
    offs = [ours.fields[f"tma_{t}"][1] for t in ("q", "k", "v", "do")]
    assert offs[0] >= theirs.itemsize and offs[0] % 64 == 0
    # then dq_writer's map of the dQ accumulator (appended last)
    assert offs == [offs[0] + 128 * i for i in range(4)] and ours.fields["tma_dq"][1] == offs[0] + 512
    # then the dynamic scheduler's counter (appended last), the size a multiple of the maps' 64
    assert ours.fields["tile_counter"][1] == offs[0] + 640 and ours.itemsize == offs[0] + 640 + 64
    assert ours.names[:len(FAM.pointer_fields)] == FAM.pointer_fields
    assert kernel_param_decl(FAM) == "const __grid_constant__ cuflash::Sm90BwdParams"
    assert kernel_param_decl(FAM, "preprocess") == "const cuflash::BwdParams"
    assert kernel_param_decl(registry.get("fa2_bwd"), "main") == "const cuflash::BwdParams"


@pytest.fixture
def fake_encoder(monkeypatch):
    calls = []

    def encode(*args):
        calls.append(args)
        return bytes((len(calls) + j) % 256 for j in range(128))

    monkeypatch.setattr(sm90_fwd, "_encoder", encode)
    monkeypatch.setattr(sm90_fwd, "_MAP_CACHE", {})
    return calls


@pytest.mark.parametrize("copy", [False, True], ids=["dout_in_place", "dout_copy"])
def test_plan_launches_and_writes_tensor_maps(monkeypatch, fake_encoder, copy):
    dt, launches = fake_launches(monkeypatch)
    p = problem(72, "fp16", True)
    cfg = FAM.heuristic(p).replace(dq_writer=False, dynamic=False, dq_convert=False)   # its dQ map: test_sm90_bwd_sched_cpu.py;
    # the plain grid (the dynamic scheduler: test_sm90_bwd_causal_cpu.py)
    q_st, k_st = (300 * 8 * 72, 8 * 72, 72, 1), (200 * 2 * 72, 2 * 72, 72, 1)
    do_st = (0, 8 * 72 * 2, 72 * 2, 2) if copy else q_st
    strides = {"dout": do_st, "q": q_st, "k": k_st, "v": k_st, "o": q_st, "dq": q_st, "dk": k_st, "dv": k_st}
    plan = launch.Plan(FAM, cfg, p, strides, 0.125, 0)
    ws = FAM.workspace(cfg, p, strides)
    assert ("dout_copy" in ws) == copy and "dk_accum" in ws
    ptrs = tuple(0x10000 * (i + 1) for i in range(9))
    plan.run(ptrs, 0x1000000, stream=7)
    assert [c["fn"] for c in launches] == [1001, 1000, 1002, 1003]     # preprocess, main, convert, reduce
    main = launches[1]
    n_kv = -(-200 // cfg.BN)
    assert main["grid"] == (2 * 8 * n_kv, 1, 1) and main["block"] == cfg.threads and main["smem"] == cfg.smem_bytes
    rec = np.frombuffer(main["raw"], dt)[0]
    assert tuple(int(rec[n]) for n in FAM.pointer_fields[:9]) == ptrs
    assert int(rec["dout_copy"]) == (0x1000000 + ws["dout_copy"] if copy else 0)
    do_ptr = 0x1000000 + ws["dout_copy"] if copy else ptrs[0]
    assert [a[1] for a in fake_encoder] == [ptrs[1], ptrs[2], ptrs[3], do_ptr]     # q, k, v, dO
    assert [a[2] for a in fake_encoder] == [(72, 300, 8, 2), (72, 200, 2, 2), (72, 200, 2, 2), (72, 300, 8, 2)]
    assert [a[4][1] for a in fake_encoder] == [cfg.BM, cfg.BN, cfg.BN, cfg.BM]
    assert fake_encoder[3][3] == (2 * 8 * 72, 2 * 72, 2 * 300 * 8 * 72)            # contiguous dO (copy too)
    for i, field in enumerate(("tma_q", "tma_k", "tma_v", "tma_do")):
        off = dt.fields[field][1]
        assert main["raw"][off:off + 128] == bytes((i + 1 + j) % 256 for j in range(128)), field
    assert rec["head_dim_rounded"] == cfg.head_dim == 128 and rec["seqlen_q_rounded"] == 384
    assert rec["scale_log2"] == np.float32(0.125 * fa2_fwd.LOG2E)
    plan.run(ptrs, 0x1000000, stream=7)                                # the same pointers: cached maps
    assert len(fake_encoder) == 4


# ---------------------------------------------------------------------------------------
# ptxas

@needs_nvcc
def test_ptxas_every_valid_config_no_spills_no_serialized_wgmma():
    """Every valid point of the space x dtype x mask x deterministic: no spills, no stack, no
    "wgmma ... serialized" warnings (32 instantiations, about a minute on 2 cores)."""
    configs = []
    for d, dtype, causal, det in itertools.product(HEAD_DIMS, DTYPES, (False, True), (False, True)):
        p = problem(d, dtype, causal, det)
        configs += [FAM.for_problem(c, p) for c in FAM.valid(p, 227 * 1024) if not sched(c)]
    chunks = [configs[i:i + 8] for i in range(0, len(configs), 8)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(configs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r)]
    assert not bad, "\n".join(bad)


@needs_nvcc
def test_ptxas_feature_kernels_no_spills_no_serialized_wgmma():
    """The heuristic's kernels of both head dims with each feature flag set (and all three), causal
    and not; all three with deterministic and with fp16: no spills, no stack, no serialized wgmma
    Dropout at every head dim, causal and not, and deterministic at d64 (37 instantiations with
    d256's, about a minute on 2 cores; every point of the space x dtype x mask x deterministic x flag
    set, 128 kernels, compiled clean too)."""
    configs = []
    for d, causal, feats in itertools.product(HEAD_DIMS, (False, True), FLAG_SETS):
        p = problem(d, "bf16", causal).replace(features=feats)
        configs.append(FAM.for_problem(FAM.heuristic(p), p))
    for d in HEAD_DIMS:
        p = problem(d, "bf16", True, True).replace(features=FLAG_SETS[-1])
        configs += [FAM.for_problem(FAM.heuristic(p), p),
                    FAM.for_problem(FAM.heuristic(p.replace(dtype="fp16", deterministic=False)),
                                    p.replace(dtype="fp16", deterministic=False))]
    # dropout: both head dims, causal and not; deterministic at d64 (d128's is refused: it spills)
    for d, causal in itertools.product(HEAD_DIMS, (False, True)):
        p = problem(d, "bf16", causal).replace(features=("dropout",))
        configs.append(FAM.for_problem(FAM.heuristic(p), p))
    p = problem(64, "bf16", True, True).replace(features=("dropout",))
    configs.append(FAM.for_problem(FAM.heuristic(p), p))
    assert len(set(configs)) == 12 * len(HEAD_DIMS) + 1   # 37 with d256's
    chunks = [configs[i:i + 13] for i in range(0, len(configs), 13)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(configs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r)]
    assert not bad, "\n".join(bad)


def test_other_families_sources_unchanged_by_this_one():
    """sm90_bwd's struct lives in params_sm90_bwd.cuh, which only sm90_bwd.cu includes: the other
    families' rendered source (and the code hash stamping their tuned entries) stays."""
    from cuflash.compile import render_source

    assert "params_sm90_bwd.cuh" in render_source("sm90_bwd")
    for fam in registry.families():
        if fam.name != "sm90_bwd":
            assert "Sm90BwdParams" not in render_source(fam.name), fam.name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_params_layout_matches_nvcc(tmp_path):
    """The packed Sm90BwdParams (BwdParams' fields, then the tensor maps from sizeof(BwdParams)
    on) is where nvcc puts the derived struct's fields."""
    names = ("dout", "alibi_batch_stride", "tma_q", "tma_k", "tma_v", "tma_do")
    src = tmp_path / "layout.cu"
    src.write_text('#include "params_sm90_bwd.cuh"\n#include <cstdio>\nint main() {\n'
                   '  cuflash::Sm90BwdParams p; const char* b = (const char*)&p;\n'
                   '  std::printf("%zu' + " %td" * len(names) + '\\n", sizeof(p)'
                   + "".join(f", (const char*)&p.{n} - b" for n in names) + ");\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["nvcc", "-std=c++17", "-I", str(kernel_dir()), "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True,
                                          text=True).stdout.split()]
    dt = launch.struct_dtype("Sm90BwdParams")
    assert got == [dt.itemsize] + [dt.fields[n][1] for n in names]


@pytest.mark.parametrize("causal,window", [(False, (40, 7)), (False, (-1, 37)), (False, (100, -1)),
                                           (True, (70, -1)), (False, (0, 0)), (True, (0, -1))])
def test_window_mask_of_the_kernel_matches_brute_force(causal, window):
    """sm90_bwd.cu's window path, in Python: per K/V block the Q blocks [q_block_begin,
    q_block_end) (cuflash.band mirrors mask.cuh), in each the element mask per key as the kernel
    writes it (visible queries as column offsets [lo, hi], only in needs_mask blocks), and the dQ
    turns counted from kv_block_begin. Every visible (query, key) is computed exactly once, no
    hidden one is, and each Q block's visiting K/V blocks are consecutive from kv_block_begin."""
    from cuflash.band import Band

    BM, BN = 64, 128
    for sq, sk in ((1, 17), (113, 301), (301, 113), (333, 333), (1023, 200)):
        band = Band(sq, sk, causal, window)
        left, right = band.left, 0 if causal else band.right
        seen = np.zeros((sq + BM, sk + BN), bool)
        visits = {}
        m_blocks = -(-sq // BM)
        for n in range(-(-sk // BN)):
            key0 = n * BN
            for m in range(band.q_block_begin(key0, BM), band.q_block_end(key0, BM, BN, m_blocks)):
                row0 = m * BM
                visits.setdefault(m, []).append(n)
                masked = band.needs_mask(row0, n, BN, BM)
                for key in range(key0, key0 + BN):
                    diag = key - band.offset - row0          # (the kernel subtracts 2t too)
                    lo = BM if key >= sk else diag - right if band.has_right else 0
                    hi = diag + left if band.has_left else BM
                    for c in range(BM):
                        if not masked or lo <= c <= hi:
                            assert not seen[row0 + c, key], (row0 + c, key)
                            seen[row0 + c, key] = True
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        ref = np.ones((sq, sk), bool)
        if band.has_right:
            ref &= j <= i + band.offset + right
        if band.has_left:
            ref &= j >= i + band.offset - left
        # padded rows (>= sq, LSE = +inf) and keys past sk (masked) carry no P
        got = seen[:sq, :sk]
        assert (got == ref).all(), (sq, sk)
        assert not seen[:sq, sk:].any()
        for m, ns in visits.items():
            first = band.kv_block_begin(m * BM, BM, BN)
            assert ns == list(range(first, first + len(ns))), (m, ns, first)


# ---------------------------------------------------------------------------------------
# dq_bulk: dQ_i parts through a shared-memory staging tile and cp.reduce.async.bulk (appended
# last: the field, the template flag, the name suffix, the space)

def test_dq_bulk_config_name_template_smem():
    plain = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False)
    bulk = plain.replace(dq_bulk=True)
    assert bulk.problems() == [] and bulk.name == plain.name + "_dqb"
    assert plain.template_args()[12] is False and bulk.template_args()[12] is True   # (kVarlen .. kDsDouble last)
    assert len(bulk.template_args()) >= 19
    # the plain config keeps its name expression (and so its code); the flag goes last
    assert plain.kernel_name() == "cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, false, false>"
    assert bulk.kernel_name() == ("cuflash::sm90_bwd<64, 128, 2, 2, 128, cuflash::bf16, false, false, "
                                  "false, false, false, false, true>")
    assert plain.replace(dropout=True).kernel_name().endswith("false, false, false, true>")
    assert bulk.replace(dropout=True, softcap=True).kernel_name().endswith("false, true, false, true, true>")
    assert bulk.replace(softcap=True, dropout=True).name.endswith("_drop_cap_dqb")
    # staging: per consumer warpgroup 64 rows x (dq_cols + 8) fp32 past the mbarriers (16-byte
    # aligned), or past softcap's / dropout's thread words (Sm90BwdDqStage)
    stage = 2 * 64 * (64 + 8) * 4
    assert bulk.dq_stage_bytes == stage and plain.dq_stage_bytes == 0
    assert bulk.smem_bytes == -(-(plain.smem_bytes - 1024) // 16) * 16 + stage + 1024
    cap = plain.replace(softcap=True)
    assert cap.replace(dq_bulk=True).smem_bytes == cap.smem_bytes + stage
    d64 = Sm90BwdConfig(64, 64, 2, 1, 64, "fp16", True, dq_bulk=True)
    assert d64.dq_cols == 64 and d64.dq_stage_bytes == 64 * 72 * 4 and d64.problems() == []
    # every valid dq_bulk config fits the H100 (227 KB); the largest ones are refused
    assert plain.replace(stages=3, dq_bulk=True).problems() == []
    assert any("shared memory" in w for w in
               plain.replace(stages=3, softcap=True, dropout=True, dq_bulk=True).problems())
    assert FAM.decode(FAM.encode(bulk), "bf16", False) == bulk


def test_dq_bulk_not_with_deterministic():
    bulk = Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_bulk=True)
    with pytest.raises(ConfigError, match="dq_bulk with deterministic"):
        bulk.replace(deterministic=True).validate()
    # a deterministic call takes the ordered red.add path whatever the (tuned / forced) config says
    p = problem(128, deterministic=True)
    cfg = FAM.for_problem(bulk, p)
    assert cfg.deterministic and not cfg.dq_bulk and cfg.problems() == []
    assert FAM.for_problem(bulk, problem(128)).dq_bulk
    # with dropout at d128 the dQ path is the one ptxas builds without spills (dropout_dq_path):
    # dq_bulk under softcap / ALiBi, dq_writer otherwise; refused elsewhere, set for such calls
    with pytest.raises(ConfigError, match="dropout at head_dim=128 takes dq_writer"):
        bulk.replace(dropout=True).validate()
    assert bulk.replace(dropout=True, softcap=True).problems() == []
    assert bulk.replace(dropout=True, softcap=True, window=True).dropout_dq_path() is None
    drop = problem(128).replace(features=("dropout",), dropout_p=0.1)
    got = FAM.for_problem(bulk, drop)
    assert got.dropout and got.dq_writer and not got.dq_bulk and got.problems() == []
    cap = problem(128).replace(features=("dropout", "softcap"), dropout_p=0.1, softcap=30.0)
    got = FAM.for_problem(bulk, cap)
    assert got.dropout and got.softcap and got.dq_bulk and not got.dq_writer and got.problems() == []
    d64 = Sm90BwdConfig(64, 64, 2, 1, 64, "bf16", False, dq_bulk=True)
    assert FAM.for_problem(d64, drop.replace(head_dim=64)).dq_bulk


def test_dq_bulk_in_the_space_heuristic_keeps_red_add():
    assert FAM.space["dq_bulk"] == (False, True)
    for d in HEAD_DIMS:
        for causal, det in itertools.product((False, True), (False, True)):
            p = problem(d, "bf16", causal, det)
            valid = [c for c in FAM.valid(p, 227 * 1024) if not sched(c)]
            bulk = {c.replace(dq_bulk=False) for c in valid if c.dq_bulk}
            if d == 256:   # its staging does not fit next to the d256 tile (shared memory)
                assert not bulk and "more than the 232448" in valid[0].replace(dq_bulk=True).problems()[0]
            else:
                assert bulk == {c for c in valid if not c.dq_bulk}     # every valid point has both
            assert not FAM.for_problem(FAM.heuristic(p), p).dq_bulk
            assert all(c.problems() == [] for c in map(lambda c: FAM.for_problem(c, p), valid))


def test_dq_bulk_kernel_source():
    """The kernel's staging layout matches the config's (Sm90BwdDqStage after the thread words),
    and the bulk path writes the fragments, fences, and waits before rewriting and at the end."""
    src = (kernel_dir() / "sm90_bwd.cu").read_text()
    assert "bool kDropout = false, bool kDqBulk = false" in src
    assert "static constexpr int kRowFloats = kDqN + 8;" in src
    assert "kOffset = Words::kOffset + Words::kBytes;" in src
    body = src[src.index("if constexpr (kDqBulk) {"):]
    order = ["bulk_wait_group_read<0>()", "__syncwarp()", "float2", "fence_proxy_async_smem()",
             "__syncwarp()", "bulk_reduce_add_f32(", "bulk_commit_group()"]
    pos = 0
    for token in order:
        pos = body.index(token, pos) + 1
    assert "bulk_wait_group<0>()" in src[src.rindex("epilogue"):]
    assert '#include "ptx_sm90_bulk.cuh"' in src


@needs_nvcc
def test_ptxas_dq_bulk_with_features_no_spills():
    """dq_bulk with every feature flag (all three, causal, d64 and d128; dropout alone at d64:
    d128's is refused, it spills), softcap in fp16: no spills, no stack, no serialized wgmma (6
    instantiations). The plain dq_bulk kernels are in
    test_ptxas_every_valid_config_no_spills_no_serialized_wgmma (the space)."""
    configs = []
    for d in (64, 128):   # (d256: dq_bulk's staging does not fit next to its tile)
        base = Sm90BwdConfig(64, 64 * (d // 64), 2, d // 64, d, "bf16", True, dq_bulk=True)
        configs += [base.replace(window=True, softcap=True, alibi=True),
                    base.replace(causal=False, dropout=True) if d == 64 else base.replace(causal=False, alibi=True),
                    base.replace(dtype="fp16", softcap=True)]
    assert all(c.problems(227 * 1024) == [] for c in configs)
    chunks = [configs[:3], configs[3:]]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(configs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes or serialized(r)]
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_dq_bulk_smem_matches_the_kernel(tmp_path):
    """Sm90BwdConfig.smem_bytes of dq_bulk configs (with and without the thread words) is the
    kernel's own Sm90BwdDqStage::kSmemBytes, as nvcc computes it."""
    configs = [Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, dq_bulk=True),
               Sm90BwdConfig(64, 128, 3, 2, 128, "bf16", True, dq_bulk=True),
               Sm90BwdConfig(64, 64, 2, 1, 64, "bf16", True, dq_bulk=True),
               Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", False, softcap=True, alibi=True, dq_bulk=True),
               Sm90BwdConfig(64, 64, 2, 1, 64, "bf16", False, softcap=True, dropout=True, dq_bulk=True),
               Sm90BwdConfig(64, 64, 3, 1, 64, "bf16", False, dropout=True, dq_bulk=True)]
    exprs = []
    for c in configs:
        shape = f"cuflash::Sm90BwdShape<{c.BM}, {c.BN}, {c.stages}, {c.consumers}, {c.head_dim}>"
        words = f"cuflash::Sm90BwdThreadWords<{shape}, {c.consumers}, {(int(c.softcap) + int(c.dropout)) * c.BM // 4}>"
        exprs.append(f"cuflash::Sm90BwdDqStage<{words}, {c.consumers}, {shape}::kDqN>::kSmemBytes")
    src = tmp_path / "stage.cu"
    src.write_text('#include "sm90_bwd.cu"\n#include <cstdio>\nint main() {\n'
                   + "".join(f'  std::printf("%d\\n", int({e}));\n' for e in exprs) + "}\n")
    exe = tmp_path / "stage"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-I", str(kernel_dir()), "-o", str(exe), str(src)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == [c.smem_bytes for c in configs]
