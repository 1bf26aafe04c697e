"""CPU-only checks of the kernel configurations (cuflash/families/*.py: FwdConfig, BwdConfig,
their rules, heuristics and spaces) and of the host mirror of the kernel argument structs
(cuflash/launch.py: struct_dtype, pack). No GPU and no compiler are needed."""
import itertools
import re

import numpy as np
import pytest

from cuflash import launch, registry
from cuflash.compile import kernel_dir, render_source
from cuflash.families.base import MAX_SMEM_BY_ARCH, ConfigError, default_max_smem
from cuflash.families.fa2_bwd import ROW_PAD, BwdConfig
from cuflash.families.fa2_fwd import MAX_ACCUM_REGS, MAX_HEAD_DIM, FwdConfig
from cuflash.problem import DTYPES, Problem

FWD = registry.get("fa2_fwd")
BWD = registry.get("fa2_bwd")
HEAD_DIMS = range(16, MAX_HEAD_DIM + 1, 16)
ALL_HEAD_DIMS = range(8, MAX_HEAD_DIM + 1, 8)      # what flash_attn_func accepts
ARCHS = [(8, 0), (8, 6), (9, 0)]
NAME_RE = {
    "fa2_fwd": re.compile(r"fwd_(bf16|fp16)_d(\d+)_(causal|full)_Br(\d+)_Bc(\d+)_w(\d+)_s(\d+)"),
    "fa2_bwd": re.compile(r"bwd_(bf16|fp16)_d(\d+)_(causal|full)_Br(\d+)_Bc(\d+)_w(\d+)_s(\d+)"
                          r"_x(\d+)_q(\d+)(_det)?"),
}

# Configs that break no rule, to derive one-rule-broken variants from.
GOOD = FwdConfig(Br=64, Bc=64, warps=4, stages=2, head_dim=64, dtype="bf16", causal=False)
GOOD_BWD = BwdConfig(Br=32, Bc=128, warps=4, stages=2, dsplit=1, head_dim=64, dtype="bf16",
                     causal=False)


def problem(op, head_dim, dtype="bf16", causal=False, deterministic=False):
    return Problem(op, dtype, 1, 128, 128, 1, 1, head_dim, causal, deterministic)


def space_points(family):
    keys = list(family.space)
    return [dict(zip(keys, values)) for values in itertools.product(*family.space.values())]


# ---------------------------------------------------------------------------------------
# names

@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_name_unique_across_whole_space(family):
    names = {}
    head_dims = sorted({family.head_dim_of(d) for d in HEAD_DIMS})
    for dtype, d, causal in itertools.product(DTYPES, head_dims, (False, True)):
        for cfg, _ in family.enumerate(problem(family.op, d, dtype, causal)):
            for c in (cfg, cfg.replace(deterministic=True)) if family is BWD else (cfg,):
                assert c.name not in names, f"{c} and {names[c.name]} share the name {c.name}"
                names[c.name] = c
    per_class = len(space_points(family)) * (2 if family is BWD else 1)
    assert len(names) == len(DTYPES) * len(head_dims) * 2 * per_class


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_name_is_short_and_spells_out_the_config(family, dtype, causal):
    for d in HEAD_DIMS:
        for cfg, _ in family.enumerate(problem(family.op, d, dtype, causal)):
            name = cfg.name
            # short, and safe as a file name / pytest id / CSV column
            assert len(name) <= 56, name
            assert re.fullmatch(r"[A-Za-z0-9_]+", name), name
            for part in (f"Br{cfg.Br}", f"Bc{cfg.Bc}", f"w{cfg.warps}", f"s{cfg.stages}",
                         f"d{cfg.head_dim}", dtype):
                assert part in name.split("_"), f"{part!r} missing from {name}"
            m = NAME_RE[family.name].fullmatch(name)
            assert m, name
            assert (m[1], int(m[2]), m[3] == "causal", int(m[4]), int(m[5]), int(m[6]),
                    int(m[7])) == (cfg.dtype, cfg.head_dim, cfg.causal, cfg.Br, cfg.Bc,
                                   cfg.warps, cfg.stages)
            if family is BWD:
                assert (int(m[8]), int(m[9]), bool(m[10])) == (cfg.dsplit, cfg.qsplit,
                                                              cfg.deterministic)


# ---------------------------------------------------------------------------------------
# validate() / problems()

@pytest.mark.parametrize("good", [GOOD, GOOD_BWD], ids=["fwd", "bwd"])
def test_good_config_has_no_problems(good):
    assert good.problems() == []
    assert good.problems(max_smem=good.smem_bytes) == []   # the limit is inclusive
    assert good.validate() is good


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        GOOD.replace(stages=1).validate()


# (changes to GOOD that break exactly one rule, text the message must contain)
ONE_RULE_BROKEN = {
    "Br_not_multiple_of_16_warps": ({"Br": 64, "warps": 8}, r"Br=64 must be a positive multiple of 16\*warps=128"),
    "Br_not_multiple_of_16": ({"Br": 72}, r"Br=72 must be a positive multiple of 16\*warps=64"),
    "Bc_not_multiple_of_16": ({"Bc": 40}, r"Bc must be a positive multiple of 16, got 40"),
    "Bc_zero": ({"Bc": 0}, r"Bc must be a positive multiple of 16, got 0"),
    "Bc_negative": ({"Bc": -16}, r"Bc must be a positive multiple of 16, got -16"),
    "stages_1": ({"stages": 1}, r"stages must be >= 2, got 1"),
    "stages_0": ({"stages": 0}, r"stages must be >= 2, got 0"),
    "head_dim_not_multiple_of_16": ({"head_dim": 72}, r"head_dim must be a multiple of 16 .*got 72"),
    "head_dim_zero": ({"head_dim": 0}, r"head_dim must be a multiple of 16 .*got 0"),
    "head_dim_too_big": ({"head_dim": 272}, r"head_dim must be a multiple of 16 in 16\.\.256, got 272"),
    "dtype_fp32": ({"dtype": "fp32"}, r"dtype must be one of .*'fp32'"),
    "warps_0": ({"warps": 0}, r"warps must be in 1\.\.16, got 0"),
    "warps_32": ({"warps": 32, "Br": 512}, r"warps must be in 1\.\.16, got 32"),
    # 2 m-tiles x (256 + 128) / 2 = 384 fp32 accumulators per thread
    "accumulator_registers": ({"Br": 128, "Bc": 128, "head_dim": 256},
                              rf"384 fp32 accumulator registers .*budget of {MAX_ACCUM_REGS}"),
}

ONE_RULE_BROKEN_BWD = {
    "warps_0": ({"warps": 0}, r"warps must be in 1\.\.16, got 0"),
    "qsplit_3": ({"qsplit": 3}, r"qsplit must be 1 or 2 and divide warps=4, got 3"),
    "qsplit_odd_warps": ({"qsplit": 2, "warps": 3, "Bc": 16}, r"qsplit must be 1 or 2 and divide warps=3"),
    "Bc_not_multiple_of_groups": ({"Bc": 96}, r"Bc=96 must be a positive multiple of 16\*warps/qsplit=64"),
    "Bc_zero": ({"Bc": 0}, r"Bc=0 must be a positive multiple"),
    "qsplit_splits_Br": ({"qsplit": 2, "Br": 16}, r"qsplit=2 must split Br=16 and the head-dim slice 64"),
    "qsplit_splits_head_dim": ({"qsplit": 2, "warps": 8, "head_dim": 80},
                               r"qsplit=2 must split Br=32 and the head-dim slice 80"),
    "Br_divides_row_pad": ({"Br": 48}, rf"Br must be a multiple of 16 dividing {ROW_PAD}, got 48"),
    "Br_zero": ({"Br": 0}, r"Br must be a multiple of 16 dividing"),
    "Br_threads": ({"Br": 128, "warps": 1, "Bc": 16}, r"Br=128 needs 64 threads to load LSE_i and D_i, the CTA has 32"),
    "dsplit_3": ({"dsplit": 3}, r"dsplit=3 must divide head_dim/16=4"),
    "dsplit_0": ({"dsplit": 0}, r"dsplit=0 must divide"),
    "stages_1": ({"stages": 1}, r"stages must be >= 2, got 1"),
    "head_dim_72": ({"head_dim": 72}, r"head_dim must be a multiple of 16 .*got 72"),
    "dtype_fp8": ({"dtype": "fp8"}, r"dtype must be one of .*'fp8'"),
    # 2 m-tiles x (64 + 128) = 384
    "accumulator_registers": ({"Br": 128}, rf"384 fp32 accumulator registers .*budget of {MAX_ACCUM_REGS}"),
}


def _check_one_rule(cfg, pattern):
    problems = cfg.problems()
    assert len(problems) == 1, problems
    assert re.search(pattern, problems[0]), problems[0]
    with pytest.raises(ConfigError, match=pattern) as info:
        cfg.validate()
    assert cfg.name in str(info.value)


@pytest.mark.parametrize("changes,pattern", ONE_RULE_BROKEN.values(), ids=ONE_RULE_BROKEN.keys())
def test_each_rule_fires_alone_with_its_reason(changes, pattern):
    _check_one_rule(GOOD.replace(**changes), pattern)


@pytest.mark.parametrize("changes,pattern", ONE_RULE_BROKEN_BWD.values(), ids=ONE_RULE_BROKEN_BWD.keys())
def test_each_backward_rule_fires_alone_with_its_reason(changes, pattern):
    _check_one_rule(GOOD_BWD.replace(**changes), pattern)


@pytest.mark.parametrize("cfg", [
    FwdConfig(Br=128, Bc=128, warps=8, stages=3, head_dim=256, dtype="fp16", causal=True),
    BwdConfig(Br=64, Bc=128, warps=8, stages=3, dsplit=2, head_dim=256, dtype="fp16", causal=True,
              qsplit=2)], ids=["fwd", "bwd"])
def test_shared_memory_rule(cfg):
    assert cfg.problems() == [], cfg.problems()   # no limit given: only the kernel's own rules
    limit = cfg.smem_bytes - 1
    problems = cfg.problems(max_smem=limit)
    assert problems == [f"needs {cfg.smem_bytes} bytes of shared memory, the device allows {limit}"]
    with pytest.raises(ConfigError, match=rf"needs {cfg.smem_bytes} bytes of shared memory"):
        cfg.validate(max_smem=limit)
    assert cfg.validate(max_smem=cfg.smem_bytes) is cfg


def test_several_problems_are_all_reported():
    cfg = FwdConfig(Br=72, Bc=40, warps=4, stages=1, head_dim=72, dtype="fp8", causal=False)
    problems = cfg.problems(max_smem=1024)
    # the shared-memory rule is only checked for an otherwise valid config
    assert len(problems) == 5, problems
    with pytest.raises(ConfigError) as info:
        cfg.validate(max_smem=1024)
    for word in ("dtype", "head_dim", "Br=72", "Bc", "stages"):
        assert word in str(info.value)


def test_accumulator_budget_boundary():
    # accum_regs = m_tiles * (head_dim + Bc) / 2 with m_tiles = Br / (16 warps)
    at_budget = FwdConfig(128, 64, 4, 2, 128, "bf16", False)      # 2 * 192 / 2 = 192
    over = FwdConfig(128, 128, 4, 2, 128, "bf16", False)          # 2 * 256 / 2 = 256
    assert at_budget.accum_regs == 192 and not at_budget.problems()
    assert over.accum_regs == 256 and "accumulator" in over.problems()[0]
    assert FwdConfig(128, 64, 8, 2, 256, "bf16", False).accum_regs == 160
    # backward: m_tiles * (head_dim / dsplit + Br) / qsplit, m_tiles = Bc * qsplit / (16 warps)
    assert BwdConfig(32, 128, 4, 2, 1, 64, "bf16", False).accum_regs == 2 * (64 + 32) == 192
    assert BwdConfig(64, 128, 8, 2, 1, 128, "bf16", False, qsplit=2).accum_regs == 2 * (128 + 64) // 2
    assert BwdConfig(32, 64, 4, 2, 2, 256, "bf16", False).accum_regs == 1 * (128 + 32)


@pytest.mark.parametrize("Br", [0, -64])
def test_nonpositive_Br_is_rejected(Br):
    assert GOOD.replace(Br=Br).problems()
    assert GOOD_BWD.replace(Br=Br).problems()


# ---------------------------------------------------------------------------------------
# smem_bytes, threads

def test_smem_bytes_by_hand():
    cfg = FwdConfig(Br=128, Bc=64, warps=4, stages=2, head_dim=128, dtype="bf16", causal=False)
    # Q tile 128 rows + 2 stages x (K + V) x 64 rows = 384 rows of (128 + 8) 2-byte elements
    assert cfg.smem_bytes == 384 * 136 * 2 == 104448
    cfg = FwdConfig(Br=64, Bc=32, warps=4, stages=3, head_dim=16, dtype="fp16", causal=True)
    assert cfg.smem_bytes == (64 + 3 * 2 * 32) * (16 + 8) * 2 == 12288
    assert cfg.threads == 128
    # backward: K_j, V_j + stages x (Q_i, dO_i) rows of (d + 8); dSᵀ (and Pᵀ with qsplit 2)
    # Bc x (Br + 8); stages x (LSE_i, D_i) fp32 rows
    cfg = BwdConfig(32, 128, 4, 2, 1, 64, "bf16", False)
    assert cfg.smem_bytes == 2 * ((2 * 128 + 2 * 2 * 32) * 72 + 128 * 40) + 8 * 2 * 32
    assert cfg.replace(qsplit=2).smem_bytes == cfg.smem_bytes + 2 * 128 * 40
    assert cfg.threads == 128


# ---------------------------------------------------------------------------------------
# the heuristics

def test_head_dim_of_rounds_up():
    for d in range(1, MAX_HEAD_DIM + 1):
        kd = FWD.head_dim_of(d)
        assert kd % 16 == 0 and d <= kd < d + 16
        bd = BWD.head_dim_of(d)
        assert d <= bd and (bd == kd if d <= 128 else bd % 32 == 0 and bd < d + 32)
    assert [FWD.head_dim_of(d) for d in (8, 16, 24, 40, 248, 256)] == [16, 16, 32, 48, 256, 256]
    assert [BWD.head_dim_of(d) for d in (40, 128, 136, 144, 168, 256)] == [48, 128, 160, 160, 192, 256]


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm{a[0]}{a[1]}")
@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_heuristic_valid_everywhere(family, arch):
    max_smem = MAX_SMEM_BY_ARCH[arch]
    for d, dtype, causal, det in itertools.product(ALL_HEAD_DIMS, DTYPES, (False, True), (False, True)):
        p = problem(family.op, d, dtype, causal, det)
        cfg = family.heuristic(p, arch)
        assert isinstance(cfg, family.config_cls)
        assert cfg.problems(max_smem) == [], (d, dtype, causal, cfg.name)
        assert cfg.head_dim == family.head_dim_of(d), (d, cfg.name)
        assert (cfg.dtype, cfg.causal) == (dtype, causal)
        assert family.fits(cfg, p) == ""
        if family is BWD:
            assert cfg.deterministic == det
        # an explicit max_smem equal to the arch's gives the same answer
        assert family.heuristic(p, arch, max_smem) == cfg


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_heuristic_fits_99kb_on_sm86_and_unknown_archs(family):
    for d, dtype, causal in itertools.product(ALL_HEAD_DIMS, DTYPES, (False, True)):
        for arch in ((8, 6), (7, 5)):   # an unknown arch assumes the small shared memory
            cfg = family.heuristic(problem(family.op, d, dtype, causal), arch)
            assert cfg.smem_bytes <= 99 * 1024, (arch, cfg.name)
    assert default_max_smem((7, 5)) == 99 * 1024


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_heuristic_raises_when_nothing_fits(family):
    with pytest.raises(ConfigError, match="shared memory"):
        family.heuristic(problem(family.op, 128), max_smem=1024)


# ---------------------------------------------------------------------------------------
# the spaces: enumerate / valid

@pytest.mark.parametrize("max_smem", [None, 99 * 1024, 227 * 1024])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 200, 256])
@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_space_covers_every_point_once(family, head_dim, max_smem):
    p = problem(family.op, head_dim, "fp16", True)
    points = list(family.enumerate(p, max_smem))
    keys = tuple(family.space)
    got = [tuple(getattr(cfg, k) for k in keys) for cfg, _ in points]
    want = [tuple(pt.values()) for pt in space_points(family)]
    assert len(got) == len(set(got)) == len(want)
    assert set(got) == set(want)
    for cfg, problems in points:
        assert (cfg.head_dim, cfg.dtype, cfg.causal) == (family.head_dim_of(head_dim), "fp16", True)
        assert problems == cfg.problems(max_smem)
        assert family.point(cfg) == dict(zip(keys, (getattr(cfg, k) for k in keys)))
    valid = family.valid(p, max_smem)
    assert valid == [cfg for cfg, problems in points if not problems]
    assert all(not cfg.problems(max_smem) for cfg in valid)


@pytest.mark.parametrize("arch", [None] + ARCHS, ids=lambda a: "nolimit" if a is None else f"sm{a[0]}{a[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_valid_configs_non_empty(family, head_dim, arch):
    max_smem = None if arch is None else MAX_SMEM_BY_ARCH[arch]
    for dtype, causal in itertools.product(DTYPES, (False, True)):
        p = problem(family.op, head_dim, dtype, causal)
        valid = family.valid(p, max_smem)
        if family is BWD and head_dim == 256 and arch == (8, 6):
            # no point of the backward space fits 99 KB at d256: the heuristic shrinks below it
            assert not family.heuristic(p, arch).problems(max_smem)
            continue
        assert valid, (head_dim, dtype, causal, arch)
        # the heuristic's pick is one of the points the tuner would try (its parameters)
        if arch is not None and head_dim <= 128:
            h = family.heuristic(p, arch)
            assert family.point(h) in [family.point(c) for c in valid], h.name


def test_make_checks_the_point():
    p = problem("fwd", 64)
    assert FWD.make({"Br": 64, "Bc": 32, "warps": 4, "stages": 2}, p) == \
        FwdConfig(64, 32, 4, 2, 64, "bf16", False)
    with pytest.raises(ValueError, match=r"unknown \['dsplit'\], missing \['stages'\]"):
        FWD.make({"Br": 64, "Bc": 32, "warps": 4, "dsplit": 2}, p)


def test_neighbours_are_one_step_away():
    cfg = FwdConfig(128, 64, 4, 2, 64, "bf16", False)
    got = FWD.neighbours(cfg)
    assert {"Br": 64, "Bc": 64, "warps": 4, "stages": 2} in got
    assert {"Br": 128, "Bc": 128, "warps": 4, "stages": 2} in got
    assert {"Br": 128, "Bc": 32, "warps": 4, "stages": 2} in got
    for pt in got:
        assert sum(pt[k] != getattr(cfg, k) for k in pt) == 1


# ---------------------------------------------------------------------------------------
# kernel names

def test_kernel_name_example():
    cfg = FwdConfig(Br=128, Bc=64, warps=4, stages=2, head_dim=128, dtype="bf16", causal=True)
    assert cfg.kernel_name() == ("cuflash::fa2_fwd<128, 64, 4, 2, 128, cuflash::bf16, true, false, false, "
                                 "false, false, false>")
    assert (cfg.replace(dtype="fp16", causal=False).kernel_name()
            == "cuflash::fa2_fwd<128, 64, 4, 2, 128, cuflash::fp16, false, false, false, false, false, false>")
    assert (cfg.replace(varlen=True).kernel_name()
            == "cuflash::fa2_fwd<128, 64, 4, 2, 128, cuflash::bf16, true, true, false, false, false, false>")
    assert (cfg.replace(dropout=True).kernel_name()
            == "cuflash::fa2_fwd<128, 64, 4, 2, 128, cuflash::bf16, true, false, true, false, false, false>")
    assert (cfg.replace(window=True, alibi=True).kernel_name()
            == "cuflash::fa2_fwd<128, 64, 4, 2, 128, cuflash::bf16, true, false, false, true, false, true>")
    bwd = BwdConfig(64, 128, 8, 2, 1, 128, "fp16", True, True, qsplit=2)
    assert bwd.kernel_name() == ("cuflash::fa2_bwd<64, 128, 8, 2, 1, 2, 128, cuflash::fp16, true, true, "
                                 "false, false, false, false, false>")
    assert BWD.kernel_names(bwd) == {
        "main": bwd.kernel_name(), "preprocess": "cuflash::fa2_bwd_preprocess<cuflash::fp16>",
        "convert_dq": "cuflash::fa2_bwd_convert_dq<cuflash::fp16>",
        "reduce_dkv": "cuflash::fa2_bwd_reduce_dkv<cuflash::fp16>"}
    vbwd = bwd.replace(varlen=True)
    assert vbwd.name.endswith("_varlen")
    assert BWD.kernel_names(vbwd) == {
        "main": "cuflash::fa2_bwd<64, 128, 8, 2, 1, 2, 128, cuflash::fp16, true, true, true, false, false, false, "
                "false>",
        "preprocess": "cuflash::fa2_bwd_preprocess<cuflash::fp16, true>",
        "convert_dq": "cuflash::fa2_bwd_convert_dq<cuflash::fp16, true>",
        "reduce_dkv": "cuflash::fa2_bwd_reduce_dkv<cuflash::fp16, true>"}
    assert FWD.kernel_names(cfg) == {"main": cfg.kernel_name()}


def _template_params(family):
    """[(kind, name)] of the template parameters of the family's main kernel, from its source."""
    src = render_source(family.name)
    main = family.kernel_names(family.heuristic(problem(family.op, 64)))["main"]
    fn = main.split("<")[0].split("::")[-1]
    m = re.search(r"template\s*<([^>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?"
                  + fn + r"\s*\(", src)
    assert m, f"no __global__ template {fn} in {family.name}.cu"
    return [tuple(p.split()) for p in m.group(1).replace("\n", " ").split(",")]


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_kernel_name_matches_template_parameter_order(family):
    """The name expression's arguments are template_args() in order, and the C++ template
    declares parameters of those kinds in that order."""
    names = set()
    for dtype, causal in itertools.product(DTYPES, (False, True)):
        for cfg, _ in family.enumerate(problem(family.op, 96, dtype, causal)):
            main = family.kernel_names(cfg)["main"]
            args = [a.strip() for a in main[main.index("<") + 1:-1].split(",")]
            want = [{True: "true", False: "false"}[a] if isinstance(a, bool)
                    else f"cuflash::{a}" if isinstance(a, str) else str(a) for a in cfg.template_args()]
            assert args == want, (main, cfg)
            names.add(main)
    assert len(names) == 4 * len(space_points(family))
    params = _template_params(family)
    kinds = ["bool" if isinstance(a, bool) else "class" if isinstance(a, str) else "int"
             for a in cfg.template_args()]
    assert [p[0] for p in params] == kinds, params


# ---------------------------------------------------------------------------------------
# launch.struct_dtype: the NumPy mirror of the params structs

_C_SIZES = {"const void*": 8, "void*": 8, "const float*": 8, "float*": 8, "int*": 8,
            "i64": 8, "int": 4, "float": 4}


def _header_fields(struct):
    """(type, name) of each field of `struct` in params.cuh, read independently of launch.py."""
    text = (kernel_dir() / "params.cuh").read_text()
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\};", text, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if line:
            m = re.fullmatch(r"(.+?)\s*(\w+)\s*;", line)
            assert m, f"unexpected line in struct {struct}: {line!r}"
            fields.append((" ".join(m[1].replace("*", " * ").split()).replace(" *", "*"), m[2]))
    return fields


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_struct_dtype_field_names_follow_header(family):
    dt = launch.struct_dtype(family.params_struct)
    fields = _header_fields(family.params_struct)
    assert list(dt.names) == [name for _, name in fields]
    assert dt.names[:len(family.pointer_fields)] == tuple(family.pointer_fields)


@pytest.mark.parametrize("struct,size", [("FwdParams", 240), ("BwdParams", 480)])
def test_struct_dtype_layout_follows_c_rules(struct, size):
    dt = launch.struct_dtype(struct)
    assert dt.itemsize == size
    assert dt.isalignedstruct
    offset = 0
    for ctype, name in _header_fields(struct):
        size = _C_SIZES[ctype]
        offset = -(-offset // size) * size                  # natural alignment
        field_dtype, field_offset = dt.fields[name][:2]
        assert field_dtype.itemsize == size, name
        assert field_offset == offset, (name, field_offset, offset)
        if ctype == "float":
            assert field_dtype == np.float32, name
        elif ctype == "int":
            assert field_dtype == np.int32, name
        elif ctype == "i64":
            assert field_dtype == np.int64, name
        else:
            assert field_dtype == np.uint64, name
        offset += size
    assert dt.itemsize == -(-offset // 8) * 8               # padded to the struct's alignment


def test_struct_dtype_unknown_struct():
    with pytest.raises(KeyError, match="NoSuchParams"):
        launch.struct_dtype("NoSuchParams")


def _all_fields(struct="FwdParams"):
    return {name: i + 1 for i, name in enumerate(launch.struct_dtype(struct).names)}


def test_pack_round_trip():
    values = _all_fields()
    values.update(q=0xDEADBEEF00, softmax_scale=0.125, scale_log2=0.125 * 1.4426950408889634,
                  q_row_stride=2**40)
    rec = launch.pack("FwdParams", **values)
    assert rec.shape == (1,) and rec.dtype == launch.struct_dtype("FwdParams")
    assert len(rec.tobytes()) == 240
    for name, value in values.items():
        assert rec[name][0] == pytest.approx(value), name


def test_pack_rejects_missing_fields():
    values = _all_fields()
    del values["seqlen_k"], values["lse"]
    with pytest.raises(TypeError, match=r"missing fields \['lse', 'seqlen_k'\]"):
        launch.pack("FwdParams", **values)


def test_pack_rejects_unknown_fields():
    values = _all_fields("BwdParams")
    values["dsum"] = 3
    with pytest.raises(TypeError, match=r"unknown \['dsum'\]"):
        launch.pack("BwdParams", **values)


@pytest.mark.parametrize("family", [FWD, BWD], ids=lambda f: f.name)
def test_static_params_fill_the_rest_of_the_struct(family):
    """pointer_fields + static_params() name every field of the params struct exactly once."""
    p = Problem(family.op, "bf16", 2, 300, 200, 8, 2, 72, True)
    cfg = family.heuristic(p)
    strides = {n: (1000, 100, 10) for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")}
    static = family.static_params(cfg, p, strides, family.workspace(cfg, p), 0.125, 132)
    dt = launch.struct_dtype(family.params_struct)
    assert set(static) | set(family.pointer_fields) == set(dt.names)
    assert not set(static) & set(family.pointer_fields)
    rec = launch.pack(family.params_struct, **dict.fromkeys(family.pointer_fields, 0), **static)
    assert rec["head_dim"][0] == 72 and rec["seqlen_q"][0] == 300 and rec["nheads_kv"][0] == 2
    assert rec["scale_log2"][0] == pytest.approx(0.125 * 1.4426950408889634)
