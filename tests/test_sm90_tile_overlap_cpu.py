"""sm90_fwd's tile_overlap (kTileOverlap) without a GPU: the field's rules, name, template argument
and encoding (the plain kernel's name unchanged), for_problem dropping it with features, and its
kernels (the GPU test's) compiled without spills or serialized wgmma (nvcc -cubin, sm_90a)."""
import os
import re
import shutil
import sys

import pytest

from cuflash import registry
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
PLAIN = Sm90FwdConfig(BM=128, BN=80, stages=2, consumers=2, pingpong=False, persistent=True, head_dim=256,
                      dtype="bf16", causal=False)
TOV = PLAIN.replace(tile_overlap=True)


def test_with_pingpong_too():
    assert TOV.replace(pingpong=True).problems(227 * 1024) == []


def check_flag_field(flag: str, suffix: str, arg_from_end: int, commas: int):
    """A schedule flag of sm90_fwd's config: off in PLAIN and outside the tuning space; on, the
    config validates, its name gains `suffix`, its kernel name ends with the flag's true (the plain
    kernel's name keeps no trailing flags) with `commas` template commas, template_args()[-arg_from_end]
    is the flag, and the encoding carries `flag=1` and decodes back."""
    on = PLAIN.replace(**{flag: True})
    assert not getattr(PLAIN, flag) and on.validate(227 * 1024) is on
    assert on.name == PLAIN.name + suffix
    assert PLAIN.kernel_name() == "cuflash::sm90_fwd<128, 80, 2, 2, false, true, 256, cuflash::bf16, false, false, false, false>"
    assert on.kernel_name().endswith(", false, true>") and on.kernel_name().count(",") == commas
    assert on.template_args()[-arg_from_end] is True and PLAIN.template_args()[-arg_from_end] is False
    assert flag not in FAM.encode(PLAIN) and FAM.encode(on).endswith(f",{flag}=1")
    assert FAM.decode(FAM.encode(on), "bf16", False) == on
    assert flag not in FAM.space
    return on


def test_field_name_template_and_encoding():
    # tile_overlap is the 25th argument (kDropPacked, kDropEarly, kStreamTail, kPvOverlap, kMaskedCopy, kRagKeys,
    # kPrefetch, kSAhead and kDeferMax come after it)
    check_flag_field("tile_overlap", "_tov", 10, 24)
    assert FAM.make(FAM.point(TOV), Problem(
        "fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False)).tile_overlap is False


@pytest.mark.parametrize("change,pattern", [
    (dict(persistent=False), r"needs the static persistent schedule"),
    (dict(dynamic=True), r"needs the static persistent schedule"),
    (dict(rescale_first=True), r"tile_overlap with varlen / q_double"),
    (dict(varlen=True), r"tile_overlap with varlen / q_double"),
    (dict(softcap=True), r"plain calls only"),
    (dict(dropout=True, BN=64), r"plain calls only"),
    (dict(causal=True), r"non-causal only"),
])
def test_rules(change, pattern):
    why = TOV.replace(**change).problems(227 * 1024)
    assert any(re.search(pattern, w) for w in why), why


def test_for_problem_drops_it_with_features():
    p = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False, features=("softcap",), softcap=30.0)
    assert FAM.for_problem(TOV, p).tile_overlap is False
    plain = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False)
    assert FAM.for_problem(TOV, plain) == TOV
    no_keys = Problem("fwd", "bf16", 1, 2048, 0, 8, 8, 256, False)
    assert FAM.for_problem(TOV, no_keys).tile_overlap is False


@needs_nvcc
def test_gpu_test_kernels_compile_without_spills():
    from cuflash.compile import nvcc_compile

    import sm90_fwd_cells_timing as timing

    cfgs = [c for c in timing.test_kernel_configs() if c.tile_overlap]
    assert len(cfgs) == 5
    for r in nvcc_compile(cfgs, "sm_90a"):
        assert r.spill_stores == 0 and r.spill_loads == 0 and not r.warnings, r


@needs_nvcc
def test_not_serialized():
    """ptxas reports serialized wgmmas ("(C7515) ... serialized", C7510-C7516) as ptxas *info*, which
    cuflash.compile.parse_ptxas does not count: read the log here (the first version of kTileOverlap,
    with the S GEMM issued on one path only, was serialized and ran at 0.5-0.8x)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from cuflash.compile import kernel_param_decl, render_source

    for cfg in (TOV, TOV.replace(pingpong=True, head_dim=128, BN=176)):
        e = cfg.kernel_name()
        src = "\n".join([render_source("sm90_fwd"), '#line 1 "inst"',
                         f"template __global__ void {e}({kernel_param_decl(FAM, 'main', e)});"]) + "\n"
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cu"
            path.write_text(src)
            proc = subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o",
                                   str(Path(tmp) / "k.cubin"), str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        log = proc.stderr + proc.stdout
        assert not re.search(r"\(C751[0-6]\)|serialized", log), log[-2000:]
