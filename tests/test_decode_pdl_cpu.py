"""decode_splitkv's ``pdl`` (programmatic dependent launch of the regs kernel's calls) without a GPU: the
config field's name tag, template tail (kPdl last), validation and arch check, the launches' flags and the
append / combine kernels' names, the heuristic's switches (PDL_DEFAULT, PDL_RULES, a device rule's ``pdl``),
call_config dropping it with the regs kernel, the plan's cuLaunchKernelEx attributes (a fake driver), and
nvcc: the pdl kernels compile for sm_90a without spills, their SASS carries the wait and the trigger
(ACQBULK, PREEXIT) where the default kernels' has neither (results/.../scripts/pdl_sass_check.py compares
the default kernels' SASS with an older tree's)."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from cuflash import _gpu
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, fused_combine=True, light_fence=True)
REGS = BASE.replace(regs=1)
LONG = BASE.replace(regs=6, regs_prefetch=True, regs_order=1, regs_prefetch_blocks=3)
P8K = Problem("decode", "bf16", 1, 1, 8192, 32, 8, 128)


def test_field_name_template_tail_validation():
    pdl = REGS.replace(pdl=1)
    assert REGS.name == "decode_bf16_d128_w8_n16_s3_m1_c4_fc_lf_rg1" and pdl.name == REGS.name + "_pdl1"
    assert REGS.kernel_name() == "cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, true, true, 0>"
    assert pdl.kernel_name() == ("cuflash::decode_splitkv_regs<8, 16, 1, 128, cuflash::bf16, true, true, 0, false, "
                                 "0, false, 0, 1, 0, 0, 1>")
    assert LONG.replace(pdl=2).kernel_name().endswith(", 5, true, 0, false, 1, 3, 0, 0, 2>")
    assert pdl.template_args()[-4] == 1 and REGS.template_args()[-4] == 0   # kStaged, kSpec, kPageShift follow
    assert pdl.template_args()[:-4] == REGS.template_args()[:-4]     # the other tails stay
    assert FAM.decode(FAM.encode(pdl), "bf16", False) == pdl
    assert FAM.make({k: v for k, v in FAM.point(REGS).items() if k != "pdl"}, P8K).pdl == 0
    assert not pdl.problems(232448) and not LONG.replace(pdl=2).problems(232448)
    assert any("pdl must be one of" in x for x in REGS.replace(pdl=4).problems(232448))
    assert any("pdl: an option of the regs kernel" in x for x in BASE.replace(pdl=1).problems(232448))
    cl = BASE.replace(regs=6, regs_cluster=16, fused_combine=False, light_fence=False, pdl=1)
    assert any("without regs_cluster" in x for x in cl.problems(232448))


def test_launches_and_kernel_names():
    p = P8K.replace(features=("append",))
    pdl = REGS.replace(pdl=1)
    specs = FAM.launches(pdl, p, 132)
    assert [(s.role, s.pdl) for s in specs] == [("append", True), ("main", True)]
    assert [(s.role, s.pdl) for s in FAM.launches(REGS, p, 132)] == [("append", False), ("main", False)]
    sep = pdl.replace(fused_combine=False, light_fence=False, splits=3)
    assert [(s.role, s.pdl) for s in FAM.launches(sep, P8K, 132)] == [("main", True), ("combine", True)]
    names = FAM.kernel_names(pdl)
    assert names["append"] == "cuflash::decode_append<128, cuflash::bf16, true>"
    assert names["combine"] == "cuflash::decode_combine<128, cuflash::bf16, true>"
    assert FAM.kernel_names(REGS)["append"] == "cuflash::decode_append<128, cuflash::bf16>"   # unchanged


def test_heuristic_switches(monkeypatch):
    monkeypatch.setattr(mod, "REGS_BATCH1_RULES", ())   # (its 8k-key entry sets pdl 1: test_decode_staged_cpu.py)
    assert FAM.heuristic(P8K).pdl == 0   # PDL_DEFAULT off
    monkeypatch.setattr(mod, "PDL_DEFAULT", 2)
    assert FAM.heuristic(P8K).pdl == 2 and FAM.heuristic(P8K.replace(batch=8, seqlen_k=32768)).pdl == 2
    assert FAM.heuristic(P8K, arch=(8, 0)).pdl == 0   # the regs kernel is sm_90's
    monkeypatch.setattr(mod, "PDL_RULES", ((1, 16384, 1), (8, 1 << 30, 0)))
    assert FAM.heuristic(P8K).pdl == 1 and FAM.heuristic(P8K.replace(seqlen_k=32768)).pdl == 0
    assert FAM.heuristic(P8K.replace(batch=8)).pdl == 0 and FAM.heuristic(P8K.replace(batch=16)).pdl == 2
    rule = SimpleNamespace(match={"batch": [1, 1]}, set={"pdl": 1})
    monkeypatch.setattr(mod, "PDL_RULES", ())
    monkeypatch.setattr(mod, "PDL_DEFAULT", 0)
    assert FAM.heuristic_for_device(P8K, (9, 0), None, rule).pdl == 1
    with pytest.raises(ValueError, match="pdl=4"):
        FAM.heuristic_for_device(P8K, (9, 0), None, SimpleNamespace(match={}, set={"pdl": 4}))


def test_call_config_drops_pdl_with_the_regs_kernel():
    pdl = REGS.replace(pdl=1)
    assert "needs sm_90" in FAM.tma_problem(pdl, P8K, (8, 0), 0)
    assert FAM.tma_problem(pdl, P8K, (9, 0), 0) == ""
    with pytest.raises(ValueError, match=r"\(pdl\) needs sm_90"):
        FAM.call_config(pdl, P8K, (8, 0), 0, chosen=False)
    assert FAM.call_config(pdl, P8K, (8, 0), 0, chosen=True).pdl == 0
    d64 = P8K.replace(head_dim=64)
    assert FAM.call_config(pdl, d64, (9, 0), 0, chosen=True).pdl == 0   # the regs kernel off: pdl too
    # small pages on the Hopper loop (REGS_PAGED_TMA_MAX_KEYS): no pdl there
    paged = Problem("decode", "bf16", 1, 1, 4096, 32, 8, 128, features=("paged_kv",))
    tma = FAM.call_config(LONG.replace(pdl=1, regs_order=0, regs_prefetch=False, regs_prefetch_blocks=1), paged,
                          (9, 0), 16, chosen=True, heuristic=True)
    assert not tma.problems(232448) and (tma.pdl == 0 or tma.regs)


class _FakeDriver:
    """Stands in for libcuda: cuLaunchKernelEx records (function, grid, block, attributes)."""

    def __init__(self):
        self.calls = []
        outer = self

        def ex(config_ptr, fn, argv, extra):
            from cuflash.launch import LaunchConfig

            c = LaunchConfig.from_address(config_ptr)
            attrs = [(c.attrs[i].id, tuple(c.attrs[i].value[:3])) for i in range(c.num_attrs)]
            outer.calls.append((fn, tuple(c.grid), tuple(c.block), attrs))
            return 0

        self.cuLaunchKernelEx = ex


def test_plan_launches_with_the_attribute(monkeypatch):
    from cuflash import launch

    plain_calls = []
    fake = _FakeDriver()
    monkeypatch.setattr(launch, "libcuda", lambda: fake)
    monkeypatch.setattr(launch, "get_kernels", lambda config, device: {
        role: SimpleNamespace(kernel=SimpleNamespace(ptr=1000 + i)) for i, role in enumerate(FAM.kernel_names(config))})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(launch, "_driver_launch", lambda: (lambda fn, *a: plain_calls.append(fn)))
    monkeypatch.setattr(launch, "_device_fns", lambda: (lambda: 0, lambda device: None))
    monkeypatch.setattr(launch, "_zeroed_i32", lambda n, device, what: SimpleNamespace(ptr=0x7000))
    monkeypatch.setattr(launch, "_stream_capturing", lambda stream: False)
    p = P8K.replace(features=("append",))
    cfg = REGS.replace(pdl=1, splits=16)
    plan = launch.Plan(FAM, cfg, p, {"call": {"seqlen_new": 1}}, 0.1, 0)
    assert isinstance(plan._launch, launch.LaunchEx) and plan._launch.clusters == {}
    from cuflash.registry import OPS

    n = len(OPS["decode"].inputs) + len(OPS["decode"].outputs)
    plan.run(tuple(range(0x1000, 0x1000 + n * 0x100, 0x100)), 0x900000, 7)
    assert plain_calls == []
    assert [(c[1], c[3]) for c in fake.calls] == [((32, 1, 1), [(6, (1, 0, 0))]), ((16, 8, 1), [(6, (1, 0, 0))])]
    # no pdl: CuPy's launchKernel as before
    plain = launch.Plan(FAM, REGS.replace(splits=16), p, {"call": {"seqlen_new": 1}}, 0.1, 0)
    assert not isinstance(plain._launch, launch.LaunchEx)
    # clusters and pdl together: both attributes on the cluster kernel
    both = launch.LaunchEx({5: (16, True), 6: (4, False), 7: (0, True)})
    assert both.clusters == {5: 16, 6: 4} and both.pdl == {5, 7}
    fake.calls.clear()
    for fn in (5, 6, 7):
        both(fn, 16, 8, 1, 256, 1, 1, 0, 3, 0, 0)
    assert [c[3] for c in fake.calls] == [[(4, (16, 1, 1)), (6, (1, 0, 0))], [(4, (4, 1, 1))], [(6, (1, 0, 0))]]
    assert ctypes.sizeof(launch.LaunchAttribute) == 72


def _cuobjdump():
    from test_sm90_softcap_cpu import _cuobjdump as find

    return find()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_sm90a_no_spills_and_sass():
    """The pdl kernels (regs 1 / the long calls' regs 6 with the early prefetch, pdl 1, 2 and 3, the append and
    combine kernels) compile for sm_90a without spills; their SASS waits (ACQBULK) before the first global
    load and triggers (PREEXIT); the default kernels carry neither."""
    from cuflash.compile import _mangled_args, kernel_param_decl, render_source

    cfgs = [REGS, LONG, REGS.replace(pdl=1), REGS.replace(pdl=2), REGS.replace(pdl=3), LONG.replace(pdl=1)]
    exprs = {e: role for c in cfgs for role, e in FAM.kernel_names(c).items()}
    lines = [render_source(FAM.name), '#line 1 "inst"']
    lines += [f"template __global__ void {e}({kernel_param_decl(FAM, role, e)});" for e, role in exprs.items()]
    tools = _cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text("\n".join(lines) + "\n")
        proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o", str(out),
                               str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill", proc.stderr)]
        assert len(spills) == 2 * len(exprs) and not any(spills), proc.stderr[-2000:]
        if tools is None:
            pytest.skip("cuobjdump / nvdisasm not found (pip download nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")
        cuobj, nvd = tools
        env = {**os.environ, "PATH": nvd + os.pathsep + os.environ.get("PATH", "")}
        text = subprocess.run([cuobj, "-sass", str(out)], check=True, capture_output=True, text=True, env=env).stdout
    for fn in text.split("Function : ")[1:]:
        name, body = fn.split("\n", 1)
        args = _mangled_args(name)
        # kPdl: the regs kernel's 16th of 19 (kStaged, kSpec, kPageShift follow); the append's and the combine's
        # third (kEarly follows)
        pdl = ("regs" in name and len(args) == 19 and args[15] != 0) or (
            "regs" not in name and len(args) >= 3 and args[2] is True)
        ops = [ln.split(";")[0].split("*/")[-1].strip() for ln in body.splitlines() if ";" in ln]
        assert ("ACQBULK" in ops) == pdl and ("PREEXIT" in ops) == pdl, (name, pdl)
        if pdl:   # the wait comes before every global load, store and atomic (predicated or not)
            first = next(i for i, o in enumerate(ops) if re.search(r"(^|\s)(LDG|STG|ATOMG|REDG|RED|ATOM)\b", o))
            assert ops.index("ACQBULK") < first, (name, ops[first])
