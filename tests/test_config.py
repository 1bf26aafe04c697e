"""CPU-only checks of the kernel configurations (cuflash/config.py) and of the host mirror of
the kernel argument struct (cuflash/params.py). No GPU and no compiler are needed."""
import itertools
import re

import numpy as np
import pytest

from cuflash import params
from cuflash.config import (DTYPES, FWD_SPACE, MAX_ACCUM_REGS, MAX_HEAD_DIM, MAX_SMEM_BY_ARCH,
                            ConfigError, FwdConfig, default_fwd_config, fwd_space,
                            kernel_head_dim, valid_fwd_configs)
from cuflash.kernels import kernel_dir

HEAD_DIMS = range(16, MAX_HEAD_DIM + 1, 16)
ALL_HEAD_DIMS = range(8, MAX_HEAD_DIM + 1, 8)      # what flash_attn_func accepts
ARCHS = [(8, 0), (8, 6), (9, 0)]
SPACE_KEYS = tuple(FWD_SPACE)                        # ("Br", "Bc", "warps", "stages")
NAME_RE = re.compile(r"fwd_(bf16|fp16)_d(\d+)_(causal|full)_Br(\d+)_Bc(\d+)_w(\d+)_s(\d+)")

# A config that breaks no rule, to derive one-rule-broken variants from.
GOOD = FwdConfig(Br=64, Bc=64, warps=4, stages=2, head_dim=64, dtype="bf16", causal=False)


def _space_points():
    return list(itertools.product(*(FWD_SPACE[k] for k in SPACE_KEYS)))


# ---------------------------------------------------------------------------------------
# names

def test_name_unique_across_whole_space():
    names = {}
    for dtype, d, causal in itertools.product(DTYPES, HEAD_DIMS, (False, True)):
        for point in _space_points():
            cfg = FwdConfig(head_dim=d, dtype=dtype, causal=causal, **dict(zip(SPACE_KEYS, point)))
            assert cfg.name not in names, f"{cfg} and {names[cfg.name]} share the name {cfg.name}"
            names[cfg.name] = cfg
    assert len(names) == len(DTYPES) * len(HEAD_DIMS) * 2 * len(_space_points())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_name_is_short_and_spells_out_the_config(dtype, causal):
    for d in HEAD_DIMS:
        for cfg, _ in fwd_space(d, dtype, causal):
            name = cfg.name
            # short, and safe as a file name / pytest id / CSV column
            assert len(name) <= 48, name
            assert re.fullmatch(r"[A-Za-z0-9_]+", name), name
            for part in (f"Br{cfg.Br}", f"Bc{cfg.Bc}", f"w{cfg.warps}", f"s{cfg.stages}",
                         f"d{cfg.head_dim}", dtype):
                assert part in name.split("_"), f"{part!r} missing from {name}"
            m = NAME_RE.fullmatch(name)
            assert m, name
            assert (m[1], int(m[2]), m[3] == "causal", int(m[4]), int(m[5]), int(m[6]),
                    int(m[7])) == (cfg.dtype, cfg.head_dim, cfg.causal, cfg.Br, cfg.Bc,
                                   cfg.warps, cfg.stages)


# ---------------------------------------------------------------------------------------
# validate() / problems()

def test_good_config_has_no_problems():
    assert GOOD.problems() == []
    assert GOOD.problems(max_smem=GOOD.smem_bytes) == []   # the limit is inclusive
    assert GOOD.validate() is GOOD


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


@pytest.mark.parametrize("changes,pattern", ONE_RULE_BROKEN.values(), ids=ONE_RULE_BROKEN.keys())
def test_each_rule_fires_alone_with_its_reason(changes, pattern):
    cfg = GOOD.replace(**changes)
    problems = cfg.problems()
    assert len(problems) == 1, problems
    assert re.search(pattern, problems[0]), problems[0]
    with pytest.raises(ConfigError, match=pattern) as info:
        cfg.validate()
    assert cfg.name in str(info.value)


def test_shared_memory_rule():
    cfg = FwdConfig(Br=128, Bc=128, warps=8, stages=3, head_dim=256, dtype="fp16", causal=True)
    assert cfg.problems() == []           # no limit given: only the kernel's own rules
    limit = cfg.smem_bytes - 1
    problems = cfg.problems(max_smem=limit)
    assert problems == [f"needs {cfg.smem_bytes} bytes of shared memory, the device allows {limit}"]
    with pytest.raises(ConfigError, match=rf"needs {cfg.smem_bytes} bytes of shared memory"):
        cfg.validate(max_smem=limit)
    assert cfg.validate(max_smem=cfg.smem_bytes) is cfg


def test_several_problems_are_all_reported():
    cfg = FwdConfig(Br=72, Bc=40, warps=4, stages=1, head_dim=72, dtype="fp8", causal=False)
    problems = cfg.problems(max_smem=1024)
    assert len(problems) == 6, problems
    with pytest.raises(ConfigError) as info:
        cfg.validate(max_smem=1024)
    for word in ("dtype", "head_dim", "Br=72", "Bc", "stages", "shared memory"):
        assert word in str(info.value)


def test_accumulator_budget_boundary():
    # accum_regs = m_tiles * (head_dim + Bc) / 2 with m_tiles = Br / (16 warps)
    at_budget = FwdConfig(128, 64, 4, 2, 128, "bf16", False)      # 2 * 192 / 2 = 192
    over = FwdConfig(128, 128, 4, 2, 128, "bf16", False)          # 2 * 256 / 2 = 256
    assert at_budget.accum_regs == 192 and not at_budget.problems()
    assert over.accum_regs == 256 and "accumulator" in over.problems()[0]
    assert FwdConfig(128, 64, 8, 2, 256, "bf16", False).accum_regs == 160


@pytest.mark.parametrize("Br", [0, -64])
def test_nonpositive_Br_is_rejected(Br):
    assert GOOD.replace(Br=Br).problems()


# ---------------------------------------------------------------------------------------
# smem_bytes, threads

def test_smem_bytes_by_hand():
    cfg = FwdConfig(Br=128, Bc=64, warps=4, stages=2, head_dim=128, dtype="bf16", causal=False)
    # Q tile 128 rows + 2 stages x (K + V) x 64 rows = 384 rows of (128 + 8) 2-byte elements
    assert cfg.smem_bytes == 384 * 136 * 2 == 104448
    cfg = FwdConfig(Br=64, Bc=32, warps=4, stages=3, head_dim=16, dtype="fp16", causal=True)
    assert cfg.smem_bytes == (64 + 3 * 2 * 32) * (16 + 8) * 2 == 12288
    assert cfg.threads == 128


# ---------------------------------------------------------------------------------------
# default_fwd_config

def test_kernel_head_dim_rounds_up_to_16():
    for d in range(1, MAX_HEAD_DIM + 1):
        kd = kernel_head_dim(d)
        assert kd % 16 == 0 and d <= kd < d + 16
    assert [kernel_head_dim(d) for d in (8, 16, 24, 40, 248, 256)] == [16, 16, 32, 48, 256, 256]


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm{a[0]}{a[1]}")
def test_default_config_valid_everywhere(arch):
    max_smem = MAX_SMEM_BY_ARCH[arch]
    for d, dtype, causal in itertools.product(ALL_HEAD_DIMS, DTYPES, (False, True)):
        cfg = default_fwd_config(d, dtype, causal, arch)
        assert isinstance(cfg, FwdConfig)
        assert cfg.problems(max_smem) == [], (d, dtype, causal, cfg.name)
        assert cfg.head_dim == kernel_head_dim(d) == -(-d // 16) * 16, (d, cfg.name)
        assert (cfg.dtype, cfg.causal) == (dtype, causal)
        # an explicit max_smem equal to the arch's gives the same answer
        assert default_fwd_config(d, dtype, causal, arch, max_smem) == cfg


def test_default_config_fits_99kb_on_sm86():
    for d, dtype, causal in itertools.product(ALL_HEAD_DIMS, DTYPES, (False, True)):
        cfg = default_fwd_config(d, dtype, causal, (8, 6))
        assert cfg.smem_bytes <= 99 * 1024, cfg.name


def test_default_config_unknown_arch_assumes_small_smem():
    for d in ALL_HEAD_DIMS:
        assert default_fwd_config(d, "bf16", False, (7, 5)).smem_bytes <= 99 * 1024


def test_default_config_raises_when_nothing_fits():
    with pytest.raises(ConfigError, match="shared memory"):
        default_fwd_config(128, "bf16", False, max_smem=1024)


# ---------------------------------------------------------------------------------------
# fwd_space / valid_fwd_configs

@pytest.mark.parametrize("max_smem", [None, 99 * 1024, 227 * 1024])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 256])
def test_fwd_space_covers_every_point_once(head_dim, max_smem):
    points = list(fwd_space(head_dim, "fp16", True, max_smem))
    got = [tuple(getattr(cfg, k) for k in SPACE_KEYS) for cfg, _ in points]
    assert len(got) == len(set(got)) == len(_space_points())
    assert set(got) == set(_space_points())
    for cfg, problems in points:
        assert (cfg.head_dim, cfg.dtype, cfg.causal) == (kernel_head_dim(head_dim), "fp16", True)
        assert problems == cfg.problems(max_smem)
    valid = valid_fwd_configs(head_dim, "fp16", True, max_smem)
    assert valid == [cfg for cfg, problems in points if not problems]
    assert all(not cfg.problems(max_smem) for cfg in valid)


@pytest.mark.parametrize("arch", [None] + ARCHS, ids=lambda a: "nolimit" if a is None else f"sm{a[0]}{a[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_valid_configs_non_empty(head_dim, arch):
    max_smem = None if arch is None else MAX_SMEM_BY_ARCH[arch]
    for dtype, causal in itertools.product(DTYPES, (False, True)):
        valid = valid_fwd_configs(head_dim, dtype, causal, max_smem)
        assert valid, (head_dim, dtype, causal, arch)
        # the heuristic's pick is one of the points the tuner would try
        if arch is not None:
            assert default_fwd_config(head_dim, dtype, causal, arch) in valid


# ---------------------------------------------------------------------------------------
# kernel_name

def test_kernel_name_example():
    cfg = FwdConfig(Br=128, Bc=64, warps=4, stages=2, head_dim=128, dtype="bf16", causal=True)
    assert cfg.kernel_name() == "cuflash::flash_fwd<128, 64, 4, 2, 128, cuflash::bf16, true>"
    assert (cfg.replace(dtype="fp16", causal=False).kernel_name()
            == "cuflash::flash_fwd<128, 64, 4, 2, 128, cuflash::fp16, false>")


def test_kernel_name_matches_template_parameter_order():
    pattern = re.compile(r"cuflash::flash_fwd<(\d+), (\d+), (\d+), (\d+), (\d+), "
                         r"cuflash::(bf16|fp16), (true|false)>")
    names = set()
    for dtype, causal in itertools.product(DTYPES, (False, True)):
        for cfg, _ in fwd_space(96, dtype, causal):
            m = pattern.fullmatch(cfg.kernel_name())
            assert m, cfg.kernel_name()
            assert (int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6], m[7] == "true") \
                == (cfg.Br, cfg.Bc, cfg.warps, cfg.stages, cfg.head_dim, cfg.dtype, cfg.causal)
            names.add(cfg.kernel_name())
    assert len(names) == 4 * len(_space_points())
    # the C++ template declares the parameters in this order
    src = (kernel_dir() / "flash_fwd.cu").read_text()
    assert re.search(r"template <int kBr, int kBc, int kWarps, int kStages, int kHeadDim, "
                     r"class Elem, bool kCausal>\s*__global__", src)


# ---------------------------------------------------------------------------------------
# params: the NumPy mirror of struct FwdParams

_C_SIZES = {"const void*": 8, "void*": 8, "float*": 8, "i64": 8, "int": 4, "float": 4}


def _header_fields(struct):
    """(type, name) of each field of `struct` in params.cuh, read independently of params.py."""
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


def test_struct_dtype_field_names_follow_header():
    dt = params.struct_dtype("FwdParams")
    fields = _header_fields("FwdParams")
    assert list(dt.names) == [name for _, name in fields]
    assert dt.names[:5] == ("q", "k", "v", "o", "lse")


def test_struct_dtype_layout_follows_c_rules():
    dt = params.struct_dtype("FwdParams")
    assert dt.itemsize == 168
    assert dt.isalignedstruct
    offset = 0
    for ctype, name in _header_fields("FwdParams"):
        size = _C_SIZES[ctype]
        offset = -(-offset // size) * size                  # natural alignment
        field_dtype, field_offset = dt.fields[name][:2]
        assert field_dtype.itemsize == size, name
        assert field_offset == offset, (name, field_offset, offset)
        if size == 8:
            assert field_offset % 8 == 0, name
        if ctype == "float":
            assert field_dtype == np.float32, name
        elif ctype == "int":
            assert field_dtype == np.int32, name
        elif ctype == "i64":
            assert field_dtype == np.int64, name
        offset += size
    assert dt.itemsize == -(-offset // 8) * 8               # padded to the struct's alignment


def test_struct_dtype_unknown_struct():
    with pytest.raises(KeyError, match="NoSuchParams"):
        params.struct_dtype("NoSuchParams")


def _all_fields():
    return {name: i + 1 for i, name in enumerate(params.struct_dtype("FwdParams").names)}


def test_pack_round_trip():
    values = _all_fields()
    values.update(q=0xDEADBEEF00, softmax_scale=0.125, scale_log2=0.125 * 1.4426950408889634,
                  q_row_stride=2**40)
    rec = params.pack("FwdParams", **values)
    assert rec.shape == (1,) and rec.dtype == params.struct_dtype("FwdParams")
    assert len(rec.tobytes()) == 168
    for name, value in values.items():
        assert rec[name][0] == pytest.approx(value), name


def test_pack_rejects_missing_fields():
    values = _all_fields()
    del values["seqlen_k"], values["lse"]
    with pytest.raises(TypeError, match=r"missing fields \['lse', 'seqlen_k'\]"):
        params.pack("FwdParams", **values)


def test_pack_rejects_unknown_fields():
    values = _all_fields()
    values["seqlen_kv"] = 3
    with pytest.raises(TypeError, match=r"unknown \['seqlen_kv'\]"):
        params.pack("FwdParams", **values)
