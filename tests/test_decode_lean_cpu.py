"""decode_splitkv's ``lean`` option without a GPU (the cp.async loop's warps keep Q's mma fragments
in registers and rescale O only when a row's running max grew): its name, template arguments and
kernel name (the plain kernel's name expression unchanged), validation (register budget, not with
the Hopper loop), the heuristic's switch (LEAN_DEFAULT, where the fragments fit), the tuning space,
and nvcc builds for sm_80 and sm_90a with zero spills."""
import shutil

import pytest

from cuflash.compile import nvcc_compile, render_source
from cuflash.families import decode_splitkv as mod
from cuflash.families.decode_splitkv import DecodeConfig
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")
BASE = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False)
P = Problem("decode", "bf16", 1, 1, 32768, 32, 8, 128)


def test_names_and_template_arguments():
    lean = BASE.replace(lean=True, fused_combine=True, l2_prefetch=256)
    assert lean.name == "decode_bf16_d128_w8_n16_s3_m1_c4_fc_l2p256_ln"
    assert BASE.template_args()[11] is False and lean.template_args()[11] is True  # kLean (kBulk follows)
    assert BASE.kernel_name() == "cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, false, false, 0, false>"
    assert lean.kernel_name() == ("cuflash::decode_splitkv<8, 16, 3, 1, 128, cuflash::bf16, true, false, 256, "
                                  "false, false, true>")
    assert BASE.replace(lean=True, page_gather=True).kernel_name().endswith("false, true, true>")
    for cfg in (BASE, lean, lean.replace(splits=9)):
        assert FAM.decode(FAM.encode(cfg), "bf16", False) == cfg
    assert FAM.make({k: v for k, v in FAM.point(BASE).items() if k != "lean"}, P).lean is False


def test_validation():
    assert not BASE.replace(lean=True).problems(232448)
    assert not BASE.replace(lean=True, head_dim=64).problems(232448)
    for bad in (BASE.replace(lean=True, m_tiles=2), BASE.replace(lean=True, head_dim=256, stages=2)):
        assert any("lean" in x and "spill" in x for x in bad.problems(232448)), bad.name
    tma = BASE.replace(tma=True, warps=4, lean=True)
    assert any("no lean" in x for x in tma.problems(232448))


def test_heuristic_switch_and_space(monkeypatch):
    assert mod.LEAN_DEFAULT is False and FAM.space["lean"] == (False,)
    assert not FAM.heuristic(P, (9, 0)).lean
    monkeypatch.setattr(mod, "LEAN_DEFAULT", True)
    assert FAM.heuristic(P, (9, 0)).lean
    gqa = P.replace(seqlen_q=5)                       # 20 packed rows: two row tiles, no room: plain
    assert FAM.heuristic(gqa, (9, 0)).m_tiles == 2 and not FAM.heuristic(gqa, (9, 0)).lean
    paged = P.replace(features=("paged_kv",))        # small pages: the Hopper loop drops it
    small = FAM.call_config(FAM.heuristic(paged, (9, 0)), paged, (9, 0), 16, chosen=True, heuristic=True)
    assert small.tma and not small.lean


def test_kernel_source():
    src = render_source("decode_splitkv")
    body = src[src.index("void attend_block("):src.index("// The warps' merge and the CTA's output")]
    assert "__any_sync(0xffffffffu, grew)" in body and "gemm_frags_x_rows" in body
    loop = src[src.index("u32 q_frag[kLean"):]
    assert loop.index("__syncthreads()") < loop.index("load_a_frags") < loop.index("attend_block<")


NVCC = shutil.which("nvcc")
POINTS = [BASE.replace(lean=True, fused_combine=True, l2_prefetch=256),
          BASE.replace(lean=True, fused_combine=True, l2_prefetch=256, warp_loads=True),
          BASE.replace(lean=True, warps=6, stages=2, fused_combine=True, l2_prefetch=256),
          BASE.replace(lean=True, head_dim=64, dtype="fp16"),
          BASE.replace(lean=True, warps=4, stages=3, page_gather=True)]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvcc_zero_spills(arch):
    for cfg, rep in zip(POINTS, nvcc_compile(POINTS, arch)):
        assert rep.spill_stores == 0 and rep.spill_loads == 0 and rep.stack_bytes == 0, (cfg.name, rep)
        assert not rep.warnings, (cfg.name, rep.warnings)
