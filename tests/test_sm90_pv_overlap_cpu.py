"""sm90_fwd's pv_overlap (kPvOverlap: the consumers' K/V loop rotated, kernels_cu/sm90_fwd_common.cuh
kRotate) without a GPU: the field's rules, name, template argument and encoding (the plain kernel's
name unchanged), for_problem dropping it with features, and the point of it in the SASS (nvcc -cubin
sm_90a, cuobjdump): the softmax of S_j (its exp2s, the row max's shuffles) sits between the wait for
S_j (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the wait for P_{j-1} V_{j-1} (... 0x0), where without the flag
ptxas put the second wait first; no spills, no serialized wgmma."""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sm90_tile_overlap_cpu import FAM, NVCC, PLAIN, check_flag_field, needs_nvcc  # noqa: E402  (PLAIN: the d256 tile)

PVO = PLAIN.replace(pv_overlap=True)


def test_field_name_template_and_encoding():
    # pv_overlap is the 29th argument (kMaskedCopy, kRagKeys, kPrefetch, kSAhead and kDeferMax after it)
    assert check_flag_field("pv_overlap", "_pvo", 6, 28) == PVO


@pytest.mark.parametrize("change", [dict(softcap=True), dict(dropout=True, BN=64), dict(window=True),
                                    dict(alibi=True)])
def test_plain_calls_only(change):
    why = PVO.replace(**change).problems(227 * 1024)
    assert any("pv_overlap with window / softcap" in w for w in why), why


def test_schedules_allowed():
    for change in (dict(pingpong=True, head_dim=128, BN=176, stream_tail=True), dict(tile_overlap=True),
                   dict(causal=True, dynamic=True, tma_store=True, pingpong=True, head_dim=128, BN=160),
                   dict(head_dim=64, BM=192, consumers=3, BN=128, dynamic=True, pingpong=True)):
        assert PVO.replace(**change).problems(227 * 1024) == [], change


def test_for_problem_drops_it_with_features():
    p = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False, features=("softcap",), softcap=30.0)
    assert FAM.for_problem(PVO, p).pv_overlap is False
    plain = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False)
    assert FAM.for_problem(PVO, plain) == PVO


def softmax_between_waits(sass: str) -> list:
    """For each WARPGROUP.DEPBAR.LE gsb0, 0x1 of a kernel's SASS: the MUFU.EX2 and SHFL issued before
    the next WARPGROUP.DEPBAR.LE gsb0, 0x0."""
    out = []
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        if "DEPBAR.LE gsb0, 0x1" in line:
            n = dict(ex2=0, shfl=0)
            for nxt in lines[i + 1:]:
                if "DEPBAR.LE gsb0, 0x0" in nxt:
                    break
                n["ex2"] += "MUFU.EX2" in nxt
                n["shfl"] += "SHFL" in nxt
            out.append(n)
    return out


def compile_clean(cfgs, sass: bool = True, fam=None) -> dict:
    """sm90_fwd `cfgs` (or family `fam`'s) compiled in one nvcc -cubin sm_90a run, checked to have no spill and
    no serialized wgmma (ptxas C7510-C7516); with sass, {template arguments: the function's SASS} (cuobjdump;
    the test skips without it), else {}."""
    fam = fam or FAM
    from cuflash.compile import _mangled_args, kernel_param_decl, render_source

    from test_sm90_softcap_cpu import _cuobjdump

    tools = _cuobjdump() if sass else None
    if sass and tools is None:
        pytest.skip("cuobjdump / nvdisasm not found (pip download nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
    lines = [render_source(fam.name), '#line 1 "inst"']
    lines += [f"template __global__ void {c.kernel_name()}({kernel_param_decl(fam, 'main')});" for c in cfgs]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text("\n".join(lines) + "\n")
        proc = subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o", str(out),
                               str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        log = proc.stderr + proc.stdout
        assert not re.search(r"\(C751[0-6]\)|serialized", log), log[-2000:]
        spills = re.findall(r"(\d+) bytes spill", log)
        assert len(spills) == 2 * len(cfgs) and not any(int(n) for n in spills), log[-2000:]
        if not sass:
            return {}
        cuobj, nvd_dir = tools
        env = {**os.environ, "PATH": nvd_dir + os.pathsep + os.environ.get("PATH", "")}
        text = subprocess.run([cuobj, "-sass", str(out)], check=True, capture_output=True, text=True, env=env).stdout
    return {_mangled_args(fn.split("\n")[0].strip()): fn for fn in text.split("Function : ")[1:]}


@needs_nvcc
def test_softmax_under_the_own_pv_in_sass():
    cfgs = [PLAIN, PVO, PVO.replace(pingpong=True, head_dim=128, BN=176, stream_tail=True),
            PVO.replace(head_dim=64, BM=192, consumers=3, BN=128, dynamic=True, pingpong=True)]
    by = compile_clean(cfgs)
    # the plain loop: the wait for P_{j-1} V_{j-1} right after S_j's, the softmax after both (nvcc 13.0)
    assert softmax_between_waits(by[tuple(PLAIN.template_args())]) == [dict(ex2=0, shfl=0)]
    for c in cfgs[1:]:
        # BN / 2 exp2s of P, alpha's two (and the first block's l init none): the whole step
        assert softmax_between_waits(by[tuple(c.template_args())]) == [dict(ex2=c.BN // 2 + 2, shfl=4)], c.name


# ---- cluster (kCluster: clusters of 2 CTAs sharing each K/V load by multicast) ----
CL = PLAIN.replace(cluster=True)


def test_cluster_name_template_and_encoding():
    assert CL.validate(227 * 1024) is CL and CL.name == PLAIN.name + "_cl2"
    assert CL.kernel_name() == ("cuflash::sm90_fwd_cluster<2, 128, 80, 2, 2, false, true, 256, cuflash::bf16, false, "
                                "false, false, false>")
    assert CL.template_args() == (2,) + PLAIN.template_args()
    assert "cluster" not in FAM.encode(PLAIN) and FAM.encode(CL).endswith(",cluster=1")
    assert FAM.decode(FAM.encode(CL), "bf16", False) == CL and "cluster" not in FAM.space


@pytest.mark.parametrize("change,pattern", [
    (dict(persistent=False), r"static persistent"), (dict(dynamic=True), r"static persistent"),
    (dict(causal=True), r"non-causal"), (dict(stream_tail=True), r"non-causal"),
    (dict(tile_overlap=True), r"non-causal"), (dict(q_double=True), r"non-causal"),
    (dict(head_dim=192, BN=112), r"must be even"), (dict(head_dim=64, BN=128), r"must be even"),
    (dict(softcap=True), r"plain calls only"),
])
def test_cluster_rules(change, pattern):
    why = CL.replace(**change).problems(227 * 1024)
    assert any(re.search(pattern, w) for w in why), why


def test_cluster_for_problem_and_grid():
    even = Problem("fwd", "bf16", 8, 2048, 2048, 8, 8, 256, False)          # 16 Q blocks per head
    assert FAM.for_problem(CL, even) == CL
    assert FAM.for_problem(CL, Problem("fwd", "bf16", 1, 2049, 2048, 8, 8, 256, False)).cluster is False  # 17
    assert FAM.for_problem(CL, Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, True)).cluster is False
    soft = Problem("fwd", "bf16", 1, 2048, 2048, 8, 8, 256, False, features=("softcap",), softcap=30.0)
    assert FAM.for_problem(CL, soft).cluster is False
    assert FAM.launches(CL, even, 132)[0].grid == (132, 1, 1)
    assert FAM.launches(CL, even, 131)[0].grid == (130, 1, 1)                     # an even grid
    small = Problem("fwd", "bf16", 1, 256, 256, 1, 1, 256, False)                # 2 tiles
    assert FAM.launches(CL, small, 132)[0].grid == (2, 1, 1)


@needs_nvcc
def test_cluster_kernels_compile_without_spills():
    from cuflash.compile import nvcc_compile

    cfgs = [CL, CL.replace(pv_overlap=True), CL.replace(head_dim=128, BN=176, pingpong=True),
            CL.replace(dtype="fp16")]
    for r in nvcc_compile(cfgs, "sm_90a"):
        assert r.spill_stores == 0 and r.spill_loads == 0 and not r.warnings, r
