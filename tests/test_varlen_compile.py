"""Ahead-of-time checks of the variable-length kernels (kernels_cu/varlen.cuh), no GPU needed:
the varlen instantiations that selection builds (the heuristics, fa2_fwd and fa2_bwd, with the
call's varlen flag applied by for_problem) compile with nvcc for sm_80 and sm_90a; the
forward spills nothing (as tests/test_compile.py demands of the fixed-length heuristic) and
the backward spills at most a few bytes more than its fixed-length twin (fa2_bwd's heuristic
sits at the register budget and may spill: tests/test_compile.py SPILLS_ALLOWED). Registers
are reported, not held: ptxas (nvcc 13.0) gives the sm_80 d64 forward 230 registers with
varlen against 168 without (sm_90a: 226 against 231).
Run with -s to see the table.
"""
import shutil

import pytest

from cuflash import registry
from cuflash.compile import nvcc_compile
from cuflash.families.fa2_fwd import FwdConfig
from cuflash.problem import Problem

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

ARCHS = {"sm_80": (8, 0), "sm_90a": (9, 0)}
EXTRA_SPILL = 32  # bytes of spill stores a varlen backward may add to its fixed-length twin


def varlen_problem(op, d, dtype, causal, deterministic=False):
    return Problem(op, dtype, 3, 1000, 1200, 4, 2, d, causal, deterministic, ("varlen",))


def heuristic_pairs(op, cc):
    """(fixed-length config, varlen config) of the heuristic at head dims 64, 128, 256 (the
    flags rotate), as selection makes them."""
    fam = registry.get("fa2_fwd" if op == "fwd" else "fa2_bwd")
    out = []
    for i, d in enumerate((64, 128, 256)):
        dtype, causal, det = (("bf16", True, False), ("fp16", False, True), ("bf16", False, True))[i]
        p = varlen_problem(op, d, dtype, causal, det if op == "bwd" else False)
        cfg = fam.for_problem(fam.heuristic(p, cc), p)
        out.append((cfg.replace(varlen=False), cfg))
    return fam, out


def test_varlen_configs_are_what_selection_builds():
    from cuflash.select import choose

    p = varlen_problem("fwd", 128, "bf16", True)
    fam, cfg, _ = choose(p, (9, 0))
    assert fam.name == "sm90_fwd" and cfg.varlen  # the Hopper forward on the H100 (test_sm90_varlen_cpu.py)
    fam, cfg, _ = choose(p, (8, 0))
    assert fam.name == "fa2_fwd" and cfg.varlen
    fam, cfg, _ = choose(varlen_problem("bwd", 64, "fp16", False, True), (8, 0))
    assert fam.name == "fa2_bwd" and cfg.varlen and cfg.deterministic
    # window / softcap / ALiBi / dropout with varlen: supported (tests/test_varlen_features_cpu.py)
    assert registry.get("fa2_fwd").supports((9, 0), p.replace(features=("varlen", "window"))) == ""
    assert cfg.name.endswith("_varlen") and FwdConfig(128, 64, 4, 2, 64, "bf16", True).varlen is False


@needs_nvcc
@pytest.mark.parametrize("op", ["fwd", "bwd"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_varlen_heuristics_compile(op, arch):
    fam, pairs = heuristic_pairs(op, ARCHS[arch])
    fixed = nvcc_compile([a for a, _ in pairs], arch)
    varlen = nvcc_compile([b for _, b in pairs], arch)
    for (a, b), ra, rb in zip(pairs, fixed, varlen):
        print(f"{arch} {b.name}: {rb.registers} regs, {rb.spill_stores} B spill stores "
              f"(fixed-length: {ra.registers} regs, {ra.spill_stores} B)")
        if op == "fwd":
            assert rb.spill_stores == 0 and rb.spill_loads == 0, (b.name, rb)
        assert rb.spill_stores <= ra.spill_stores + EXTRA_SPILL, (b.name, ra, rb)
