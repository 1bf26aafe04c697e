"""CPU checks of sm90_fwd's software exp2 (emu_exp2, kEmuExp2; kernels_cu/exp2_emu.cuh; issue 12,
softcap at <= 10% over the plain forward): a NumPy mirror of exp2_poly (accuracy over [-127, 0],
exactness at -inf, 0 and the integers, NaN kept), the tile pattern, the config field (rules, name,
kernel name, encoding, space, heuristic), and the nvcc build: zero spills at the heuristic tiles
and fewer MUFU (SFU) instructions per score in the SASS. No GPU is needed; the kernel itself is
checked on the GPU (tests/test_sm90_softcap_gpu.py) and timed by tests/sm90_softcap_timing.py."""
import collections
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cuflash import registry
from cuflash.families.base import ConfigError
from cuflash.families.sm90_fwd import (EMU_EXP2, EMU_EXP2_SPACE, HEAD_DIMS, SOFTCAP_EMU_EXP2,
                                       Sm90FwdConfig)
from cuflash.problem import Problem

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "kernels_cu" / "exp2_emu.cuh"
FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")


def _cuobjdump():
    """cuobjdump with nvdisasm next to it (PATH, else the pip wheels unpacked under /tmp)."""
    for cuobj, nvd in ((shutil.which("cuobjdump"), shutil.which("nvdisasm")),
                       ("/tmp/cuobj/x/nvidia/cu13/bin/cuobjdump", "/tmp/nvd/x/nvidia/cu13/bin/nvdisasm")):
        if cuobj and nvd and Path(cuobj).exists() and Path(nvd).exists():
            return cuobj, str(Path(nvd).parent)
    return None


# ---------------------------------------------------------------------------------------
# the NumPy mirror of exp2_poly

def header_coefficients() -> dict:
    """{degree: [c0, c1, ..., cn]} as exp2_poly's Horner steps write them (c0 = 1)."""
    text = HEADER.read_text()
    body = text[text.index("float exp2_poly(float x)"):text.index("Exp2PolyDegree")]
    three, four = body.split("} else {")
    four = four.split("}")[0]
    out = {}
    for degree, block in ((3, three), (4, four)):
        nums = [float(v) for v in re.findall(r"fmaf\((?:p|[-0-9.e]+f), f, ([-0-9.e]+)f\)", block)]
        lead = float(re.search(r"fmaf\(([-0-9.e]+)f, f,", block).group(1))
        # Horner from the top: lead·f + c_{n-1}, then p·f + c_{n-2}, ... , p·f + 1 (after the if)
        out[degree] = [1.0] + nums[::-1] + [lead]
    return out


def fma32(a, b, c):
    """float32 fma: one rounding of a·b + c (the float64 product of two float32 is exact)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def exp2_poly(x, degree: int) -> np.ndarray:
    """exp2_poly<degree> in float32, step by step as the kernel does it (no FTZ: values below
    2^-126 come out subnormal here, flushed on the GPU)."""
    c = [np.float32(v) for v in header_coefficients()[degree]]
    x = np.asarray(x, np.float32)
    x = np.where(x < np.float32(-127), np.float32(-127), x)          # NaN fails the compare
    shifter = np.float32(12582912.0)
    t = (x + shifter).astype(np.float32)
    j = (t - shifter).astype(np.float32)
    f = (x - j).astype(np.float32)
    p = np.full_like(f, c[-1])
    for ck in c[-2::-1]:
        p = fma32(p, f, np.full_like(f, ck))
    bits = (t.view(np.uint32).astype(np.uint64) << 23) + (127 << 23)
    two_j = (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (p * two_j).astype(np.float32)


# the polynomial's relative error bound on [-126, 0] (exp2_poly_fit.py prints 1.01e-4 / 2.9e-6)
REL_ERR = {3: 1.05e-4, 4: 3.0e-6}


@pytest.mark.parametrize("degree", (3, 4))
def test_exp2_poly_relative_error_over_the_softmax_range(degree):
    rng = np.random.default_rng(degree)
    x = np.concatenate([np.linspace(-126, 0, 2_000_001, dtype=np.float32),
                        rng.uniform(-126, 0, 1_000_000).astype(np.float32),
                        -rng.exponential(1e-3, 100_000).astype(np.float32),   # near the max
                        np.float32(-0.5) + rng.uniform(-1e-3, 1e-3, 10_000).astype(np.float32)])
    got = exp2_poly(x, degree).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1)
    assert rel.max() <= REL_ERR[degree], (degree, rel.max(), x[rel.argmax()])


@pytest.mark.parametrize("degree", (3, 4))
def test_exp2_poly_special_values(degree):
    # -inf (a masked score) gives exactly +0.0; 0 (the row's max) exactly 1
    r = exp2_poly(np.array([-np.inf, 0.0, -0.0], np.float32), degree)
    assert r[0] == 0 and not np.signbit(r[0]) and r[1] == 1 and r[2] == 1
    # integers: exactly 2^j (p(0) = 1, 2^j built in the exponent bits)
    j = np.arange(-126, 1, dtype=np.float32)
    assert np.array_equal(exp2_poly(j, degree), np.exp2(j.astype(np.float64)).astype(np.float32))
    # below -126: at most 2^-126 (the GPU's FTZ flushes it to 0, as ex2.approx.ftz does)
    tiny = exp2_poly(np.linspace(-200, -126, 10001, dtype=np.float32), degree)
    assert np.all(tiny >= 0) and tiny.max() <= np.float32(2.0 ** -126)
    # NaN stays NaN (the clamp is a compare, ptxas makes it FMNMX.NAN; NaN * 2^j is NaN)
    assert np.isnan(exp2_poly(np.array([np.nan], np.float32), degree)).all()
    # slightly above 0 (one rounding of m·scale·log2e): still accurate
    x = np.float32(1e-6) * np.arange(1, 100, dtype=np.float32)
    assert np.abs(exp2_poly(x, degree) / np.exp2(x.astype(np.float64)) - 1).max() <= REL_ERR[degree]


def test_exp2_poly_coefficients_are_the_fit():
    """The header's coefficients are what results/.../scripts/exp2_poly_fit.py computes."""
    import importlib.util

    pytest.importorskip("scipy")
    path = ROOT / "results" / "NVIDIA_H100_80GB_HBM3" / "scripts" / "exp2_poly_fit.py"
    spec = importlib.util.spec_from_file_location("exp2_poly_fit", path)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    for degree, coef in header_coefficients().items():
        assert len(coef) == degree + 1 and coef[0] == 1.0
        np.testing.assert_allclose(coef, fit.minimax(degree).astype(np.float32), rtol=2e-4, atol=1e-6)


def emulated(k: int, nt: int) -> bool:
    """exp2_emulated<k>(nt) of exp2_emu.cuh."""
    return ((nt + 1) * k) // 4 != (nt * k) // 4


def test_emulated_tile_pattern():
    for k in (1, 2, 3, 4):
        for n_tiles in (8, 16, 22, 24):  # BN 64, 128, 176, 192
            got = sum(emulated(k, nt) for nt in range(n_tiles))
            assert abs(got - k * n_tiles / 4) < 1, (k, n_tiles, got)
        # spread: never more than ceil(4 / k) tiles between two emulated ones
        idx = [nt for nt in range(64) if emulated(k, nt)]
        assert max(b - a for a, b in zip(idx, idx[1:])) <= -(-4 // k)
    assert "((nt + 1) * kEmu) / 4 != (nt * kEmu) / 4" in HEADER.read_text()


# ---------------------------------------------------------------------------------------
# the config field

def cap_problem(d=128, causal=True, dtype="bf16", features=("softcap",), **kw):
    return Problem("fwd", dtype, 2, 1000, 1000, 8, 2, d, causal, features=features,
                   softcap=30.0 if "softcap" in features else 0.0,
                   dropout_p=0.1 if "dropout" in features else 0.0, **kw)


def test_plain_names_and_encoding_unchanged():
    cfg = Sm90FwdConfig(128, 176, 2, 2, True, False, 128, "bf16", True)
    assert cfg.emu_exp2 == 0
    assert cfg.name == "sm90fwd_bf16_d128_causal_BM128_BN176_s2_c2_pp"
    assert cfg.kernel_name() == ("cuflash::sm90_fwd<128, 176, 2, 2, true, false, 128, cuflash::bf16, "
                                 "true, false, false, false>")
    assert "emu_exp2" not in FAM.encode(cfg)
    # dataclass field order: emu_exp2 right after dropout (the scheduler's, varlen's, p_smem's,
    # tree_max's and q_double's fields after it, then the softmax variants of feature calls)
    fields = list(Sm90FwdConfig.__dataclass_fields__)
    assert fields[fields.index("dropout") + 1] == "emu_exp2"
    assert fields[-21:] == ["varlen", "p_smem", "tree_max", "q_double", "lazy_rescale", "fold_cap",
                            "alibi_lin", "rescale_first", "tile_overlap", "drop_packed", "drop_early",
                            "stream_tail", "pv_overlap", "cluster", "masked_copy", "rag_keys", "prefetch",
                            "s_ahead", "defer_max", "section", "even_waves"]
    # (section: run time, not a template argument; cluster: sm90_fwd_cluster, the entry point;
    # even_waves: the launch's grid)


def test_emu_names_template_and_encoding():
    cfg = Sm90FwdConfig(128, 176, 2, 2, True, False, 128, "bf16", True, softcap=True, emu_exp2=2)
    assert cfg.name.endswith("_emu2_cap")   # the feature suffix stays last
    assert cfg.kernel_name().endswith("true, false, true, false, false, 2>")   # ..., kDropout, kEmuExp2
    args = cfg.template_args()      # then kDynamic, kTmaStore, kVarlen, kPSmem, kTreeMax, kQDouble,
    emu = list(Sm90FwdConfig.__dataclass_fields__).index("emu_exp2")   # kLazyRescale, kFoldCap, kAlibiLinear, kRescaleFirst
    assert args[emu - 1:emu + 1] == (False, 2) and args[-7:] == (False, False, False, False, 0, False, False)
    text = FAM.encode(cfg)
    assert text.endswith(",emu_exp2=2")
    back = FAM.decode(text, "bf16", True).replace(softcap=True)
    assert back == cfg
    src = (ROOT / "kernels_cu" / "sm90_fwd.cu").read_text()
    assert "bool kDropout = false, int kEmuExp2 = 0," in src and '#include "exp2_emu.cuh"' in src


def test_emu_rules():
    base = Sm90FwdConfig(128, 176, 2, 2, True, False, 128, "bf16", True)
    assert not base.replace(softcap=True, emu_exp2=2).problems()
    assert any("needs softcap" in w for w in base.replace(emu_exp2=1).problems())
    d64 = base.replace(head_dim=64, BN=192, emu_exp2=1)
    assert any("needs softcap" in w for w in d64.problems())        # no plain d64 option
    assert not d64.replace(pingpong=False, softcap=True).problems()
    assert any("emu_exp2 must be one of" in w for w in base.replace(softcap=True, emu_exp2=5).problems())
    assert any("dropout" in w for w in base.replace(BN=128, softcap=True, dropout=True, emu_exp2=2).problems())
    with pytest.raises(ConfigError, match="emu_exp2"):
        base.replace(emu_exp2=3).validate()
    assert set(EMU_EXP2_SPACE) <= set(EMU_EXP2) and 0 in EMU_EXP2_SPACE


def test_space_has_emu_only_with_softcap():
    # emu_exp2 after the layout parameters (the scheduler's options come after it)
    keys = list(FAM.space)
    assert FAM.space["emu_exp2"] == EMU_EXP2_SPACE and keys[keys.index("persistent") + 1] == "emu_exp2"
    plain128 = {c.emu_exp2 for c in FAM.valid(cap_problem(features=()))}
    assert plain128 == {0}
    assert {c.emu_exp2 for c in FAM.valid(cap_problem())} == set(EMU_EXP2_SPACE)
    assert {c.emu_exp2 for c in FAM.valid(cap_problem(d=64, features=()))} == {0}
    # a point without the knob (tuned tables from before it) is the plain kernel
    point = {k: v for k, v in FAM.point(FAM.heuristic(cap_problem(features=()))).items() if k != "emu_exp2"}
    assert FAM.make(point, cap_problem(features=())).emu_exp2 == 0


def test_heuristic():
    for d in HEAD_DIMS:
        cfg = FAM.for_problem(FAM.heuristic(cap_problem(d=d)), cap_problem(d=d))
        assert cfg.softcap and cfg.emu_exp2 == SOFTCAP_EMU_EXP2 and not cfg.problems(), cfg.name
        emu = cfg.replace(emu_exp2=2, fold_cap=0, lazy_rescale=False, masked_copy=0)   # what the tuner may pick
        assert not emu.problems(), emu.name
        plain = FAM.for_problem(FAM.heuristic(cap_problem(d=d, features=())), cap_problem(d=d, features=()))
        assert plain.emu_exp2 == 0 and not plain.softcap
    # with a window too
    p = cap_problem(features=("softcap", "window"), window=(256, 0))
    assert FAM.for_problem(FAM.heuristic(p), p).emu_exp2 == SOFTCAP_EMU_EXP2
    # with dropout: the plain exp2 (not implemented with it)
    p = cap_problem(d=64, features=("dropout", "softcap"))
    cfg = FAM.for_problem(FAM.heuristic(p), p)
    assert cfg.dropout and cfg.emu_exp2 == 0 and not cfg.problems()
    forced = FAM.for_problem(Sm90FwdConfig(128, 128, 2, 2, True, False, 64, "bf16", True, emu_exp2=2), p)
    assert forced.emu_exp2 == 0


# ---------------------------------------------------------------------------------------
# the nvcc build

def emu_configs():
    """The softcap heuristic (emu_exp2 = SOFTCAP_EMU_EXP2) at every head dim, both dtypes (bf16
    takes the degree-3 polynomial, fp16 degree 4) and both masks with 2 quarters emulated, and
    d64 softcap at each fraction of the space. (Not here: emu_exp2 1 and 4 at bf16 d128 causal BN 176 spill 8 / 20
    bytes with nvcc 13.0; the tuner may still time 1, which is in the space.)"""
    out = []
    for d in HEAD_DIMS:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                p = cap_problem(d=d, dtype=dtype, causal=causal)
                # (fold_cap, lazy_rescale and masked_copy, the d128 heuristic's, do not run with emu_exp2)
                out.append(FAM.for_problem(FAM.heuristic(p), p).replace(emu_exp2=2, fold_cap=0,
                                                                        lazy_rescale=False,
                                                                        masked_copy=0))
    for dtype in ("bf16", "fp16"):
        p = cap_problem(d=64, dtype=dtype, causal=dtype == "bf16")
        out += [FAM.for_problem(FAM.heuristic(p), p).replace(emu_exp2=e) for e in (1, 3)]
    assert all(c.emu_exp2 for c in out)
    return out


@needs_nvcc
def test_emu_instantiations_compile_without_spills():
    """26 instantiations, ~1 min on 2 cores: no spills, no stack, no wgmma serialization."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    cfgs = emu_configs()
    chunks = [cfgs[i:i + 4] for i in range(0, len(cfgs), 4)]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(cfgs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or any("C751" in w or "serialized" in w for w in r.warnings)]
    assert not bad, "\n".join(bad)


def sass_ops(cfgs) -> dict:
    """{config: Counter of SASS opcodes} of the main kernels, compiled together (nvcc + cuobjdump)."""
    from cuflash.compile import kernel_param_decl, render_source

    tools = _cuobjdump()
    if tools is None:
        pytest.skip("cuobjdump / nvdisasm not found (pip download nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
    cuobj, nvd_dir = tools
    lines = [render_source("sm90_fwd"), '#line 1 "instantiations"']
    lines += [f"template __global__ void {c.kernel_name()}({kernel_param_decl(FAM, 'main')});" for c in cfgs]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text("\n".join(lines) + "\n")
        subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-o", str(out), str(src)],
                       check=True, capture_output=True)
        env = {**os.environ, "PATH": nvd_dir + os.pathsep + os.environ.get("PATH", "")}
        sass = subprocess.run([cuobj, "-sass", str(out)], check=True, capture_output=True, text=True,
                              env=env).stdout
    by_args = {}
    for fn in sass.split("Function : ")[1:]:
        name = fn.split("\n")[0].strip()
        ops = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", fn)
        by_args[name] = (collections.Counter(ops), fn)
    from cuflash.compile import _mangled_args

    found = {_mangled_args(k): v for k, v in by_args.items()}
    return {c: found[tuple(c.template_args())] for c in cfgs}


@needs_nvcc
def test_mufu_per_score_drops():
    """MUFU.EX2 in the kernel: one per score of S in each of the two softmax copies (the first
    K/V block's and the loop's), plus alpha's; emu_exp2 = k removes k quarters of the scores'.
    MUFU.TANH (softcap) stays one per score. And the plain kernel has none of exp2_poly's code."""
    base = Sm90FwdConfig(128, 176, 2, 2, True, False, 128, "bf16", True, softcap=True)
    cfgs = [base] + [base.replace(emu_exp2=e) for e in (1, 2, 3)] + [base.replace(softcap=False)]
    ops = sass_ops(cfgs)
    scores = 2 * base.BN // 2          # per thread per softmax: BN / 2 (64 x BN over 128 threads), x2 copies
    tiles = base.BN // 8
    for cfg in cfgs[:4]:
        count, _ = ops[cfg]
        emu_tiles = sum(emulated(cfg.emu_exp2, nt) for nt in range(tiles)) if cfg.emu_exp2 else 0
        ex2_scores = scores - 2 * emu_tiles * 4
        assert count["MUFU.TANH"] == scores, (cfg.name, count["MUFU.TANH"])
        assert count["MUFU.EX2"] == ex2_scores + 2 * 2, (cfg.name, count["MUFU.EX2"])   # + alpha's 2 rows
        per_score = (count["MUFU.TANH"] + count["MUFU.EX2"] - 4) / scores
        print(f"{cfg.name}: {per_score:.3f} MUFU per score")
    count, text = ops[cfgs[-1]]
    assert count["MUFU.EX2"] == scores + 4 and "12582912" not in text     # plain: no exp2_poly
    half, _ = ops[cfgs[2]]
    assert (half["MUFU.TANH"] + half["MUFU.EX2"] - 4) / scores == 1.5
    # the clamp is one NaN-keeping FMNMX per emulated score
    assert half["FMNMX.NAN"] >= 2 * sum(emulated(2, nt) for nt in range(tiles)) * 4
