"""sm90_fwd's P through shared memory (``p_smem``, kPSmem), shorter softmax chains (``tree_max``,
kTreeMax) and two Q buffers (``q_double``, kQDouble) without a GPU: the rules (3 consumer
warpgroups, the register budgets, no tma_store at 3 consumers, plain calls only, not with emu_exp2,
shared memory), names, template arguments, shared memory,
encoding, the space, the heuristic's switch, and the sm_90a builds (nvcc -cubin: no spills, no
"wgmma serialized" warnings, at the budgets' edges)."""
import os
import re
import shutil

import pytest

from cuflash import registry
from cuflash.families import sm90_fwd
from cuflash.families.sm90_fwd import Sm90FwdConfig
from cuflash.problem import Problem

FAM = registry.get("sm90_fwd")
NVCC = os.environ.get("NVCC", "nvcc")
needs_nvcc = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
PS = Sm90FwdConfig(BM=192, BN=192, stages=2, consumers=3, pingpong=True, persistent=True, head_dim=64,
                   dtype="bf16", causal=False, dynamic=True, p_smem=True)
SMEM = 227 * 1024


def problem(head_dim=64, causal=False, features=(), **kw):
    return Problem("fwd", "bf16", 2, 2048, 2048, 16, 16, head_dim, causal, features=features, **kw)


def test_name_template_arguments_and_shared_memory():
    assert PS.validate(SMEM) is PS
    assert PS.name == "sm90fwd_bf16_d64_full_BM192_BN192_s2_c3_pp_persist_dyn_psmem"
    assert PS.kernel_name() == ("cuflash::sm90_fwd<192, 192, 2, 3, true, true, 64, cuflash::bf16, false, "
                                "false, false, false, false, 0, true, false, false, true>")
    tree = PS.replace(tree_max=True)
    assert tree.name.endswith("_psmem_tree") and tree.kernel_name().endswith("false, false, true, true>")
    assert PS.replace(p_smem=False, tree_max=True).kernel_name().endswith("true, false, false, false, true>")
    args = dict(zip(type(PS).__dataclass_fields__, PS.template_args()))   # (by field name: the feature
    assert len(PS.template_args()) == len(type(PS).__dataclass_fields__) - 3  # variants' flags follow; section: run time;
    # cluster: sm90_fwd_cluster's leading cluster size; even_waves: the grid)
    assert (args["p_smem"], args["tree_max"], args["q_double"]) == (True, False, False)
    # the P tiles: 3 warpgroups x 64 rows x 3 chunks of 64 keys x 2 bytes; BN 176 also takes 3 chunks
    assert PS.p_tile_bytes == 3 * 64 * 192 * 2
    assert PS.smem_bytes == PS.replace(p_smem=False).smem_bytes + PS.p_tile_bytes
    assert PS.replace(BN=176).p_tile_bytes == PS.p_tile_bytes
    assert PS.replace(p_smem=False).p_tile_bytes == 0
    for cfg in (PS, tree, PS.replace(causal=True, BN=176)):
        assert FAM.decode(FAM.encode(cfg), cfg.dtype, cfg.causal) == cfg
    assert "p_smem" not in FAM.encode(PS.replace(p_smem=False)) and "tree_max" not in FAM.encode(PS)


@pytest.mark.parametrize("change,pattern", [
    (dict(BM=128, consumers=2), r"p_smem needs 3 consumer warpgroups, got 2"),
    (dict(BM=64, consumers=1, pingpong=False), r"p_smem needs 3 consumer warpgroups, got 1"),
    (dict(causal=True), r"128 fp32 accumulator registers .* budget of 120 .* P in shared memory"),
    (dict(tma_store=True, BN=128), r"p_smem with tma_store and 3 consumer warpgroups spills"),
    (dict(window=True), r"p_smem with window"),
    (dict(dropout=True, BN=128), r"p_smem with window / softcap / ALiBi / dropout / varlen"),
    (dict(p_smem=False), r"128 fp32 accumulator registers .* budget of 96 with 3 consumer warpgroup\(s\): "),
    (dict(stages=3), r"needs \d+ bytes of shared memory"),
])
def test_rules(change, pattern):
    why = PS.replace(**change).problems(SMEM)
    assert any(re.search(pattern, w) for w in why), why


def test_q_double_config():
    q2 = PS.replace(q_double=True)
    assert q2.validate(SMEM) is q2 and q2.name.endswith("_psmem_q2")
    assert q2.kernel_name().endswith("false, false, true, false, true>")   # kPSmem, kTreeMax, kQDouble
    assert dict(zip(type(q2).__dataclass_fields__, q2.template_args()))["q_double"] is True
    # one more Q block (192 rows x 128 bytes) and its two mbarriers
    assert q2.smem_bytes == PS.smem_bytes + 192 * 128 + 16
    assert FAM.decode(FAM.encode(q2), "bf16", False) == q2 and FAM.encode(q2).endswith("p_smem=1,q_double=1")
    # d128's Q block is 48 KB: with the P tiles it no longer fits
    assert any("shared memory" in w for w in PS.replace(head_dim=128, BN=128, q_double=True).problems(SMEM))
    assert "q_double" not in FAM.space


def test_tree_max_rules():
    assert PS.replace(tree_max=True).validate(SMEM)
    soft = PS.replace(p_smem=False, BN=128, softcap=True, emu_exp2=1, tree_max=True)
    assert any("tree_max with emu_exp2=1" in w for w in soft.problems(SMEM))
    assert not soft.replace(tree_max=False).problems(SMEM)


def test_space_and_selection():
    assert FAM.space["p_smem"] == (False, True) and "tree_max" not in FAM.space
    valid = FAM.valid(problem(), SMEM)
    ps = [c for c in valid if c.p_smem]
    assert ps and all(c.consumers == 3 and not c.tma_store for c in ps)
    assert max(c.BN for c in ps) == 192 and max(c.BN for c in valid if c.consumers == 3 and not c.p_smem) == 128
    assert max(c.BN for c in FAM.valid(problem(causal=True), SMEM) if c.p_smem) == 176
    # a point from before the flag: off
    point = {k: getattr(PS, k) for k in FAM.space if k != "p_smem"}
    assert FAM.make(point, problem()).p_smem is False
    # with a feature the call drops p_smem (plain calls only), keeping the tile
    p = problem(features=("window",), window=(256, 0))
    cfg = FAM.for_problem(PS.replace(BN=128), p)
    assert not cfg.p_smem and cfg.window and cfg.BN == 128


def test_heuristic_switch(monkeypatch):
    """HEURISTIC_D64 replaces the plain d64 call's tile by mask from the 2048 bucket on (measured:
    3 consumer warpgroups, BM 192, BN 128); below it, with features, and at other head dims the
    tiles stay."""
    for causal in (False, True):
        cfg = FAM.heuristic(problem(causal=causal))
        assert (cfg.BM, cfg.BN, cfg.consumers, cfg.pingpong, cfg.dynamic, cfg.p_smem, cfg.tma_store) == \
            (192, 128, 3, True, True, False, False), cfg.name
        assert cfg.validate(SMEM) is cfg
        for dtype in ("bf16", "fp16"):
            big = FAM.heuristic(Problem("fwd", dtype, 1, 16384, 16384, 32, 32, 64, causal))
            assert (big.BM, big.BN, big.consumers) == (192, 128, 3)
        short = FAM.heuristic(Problem("fwd", "bf16", 16, 1024, 1024, 32, 32, 64, causal))
        # the 1024 bucket (causal: SHORT_CAUSAL_FIELDS' BN 128)
        assert (short.BM, short.BN, short.consumers) == (128, 128 if causal else 192, 2)
    assert FAM.heuristic(Problem("fwd", "bf16", 2, 1400, 1400, 16, 16, 64, False)).consumers == 2
    assert FAM.heuristic(Problem("fwd", "bf16", 2, 1500, 1500, 16, 16, 64, False)).consumers == 3
    assert FAM.heuristic(problem(head_dim=128)).consumers == 2
    # HEURISTIC_D64_Q_DOUBLE: two Q buffers for causal calls of the 2048 bucket only (measured there)
    for causal, s in ((True, 2048), (True, 2500), (True, 4096), (False, 2048)):
        cfg = FAM.heuristic(Problem("fwd", "bf16", 4, s, s, 32, 32, 64, causal))
        assert cfg.q_double == ((causal, cfg.consumers, Problem("fwd", "bf16", 4, s, s, 32, 32, 64, causal).bucket)
                                == (True, 3, 2048)), cfg.name
        assert cfg.validate(SMEM) is cfg
    soft = FAM.heuristic(problem(features=("softcap",), softcap=30.0))
    assert soft.consumers == 2 and not soft.p_smem
    # the switch is a module constant: off gives the 2-consumer tile, a p_smem tile is honoured
    monkeypatch.setattr(sm90_fwd, "HEURISTIC_D64", {})
    assert FAM.heuristic(problem()).consumers == 2
    monkeypatch.setattr(sm90_fwd, "HEURISTIC_D64", {False: dict(BM=192, consumers=3, BN=192, p_smem=True)})
    full, causal = FAM.heuristic(problem()), FAM.heuristic(problem(causal=True))
    assert (full.BM, full.BN, full.consumers, full.p_smem, full.dynamic) == (192, 192, 3, True, True)
    assert (causal.BM, causal.BN, causal.consumers) == (128, 192, 2)
    assert full.validate(SMEM) is full


def test_tma_store_with_three_consumers():
    c3 = PS.replace(p_smem=False, BN=128, tma_store=True)
    assert any("tma_store with 3 consumer warpgroups and 96 accumulator + 32 P registers" in w
               for w in c3.problems(SMEM))
    assert not c3.replace(BN=112).problems(SMEM)


def build_configs():
    """The budgets' edges (largest BN per mask and dtype), the GPU tests' kernels, the tree_max
    variants of the heuristic's d64 tile and of the p_smem tiles."""
    out = [PS.replace(p_smem=False, BN=112, tma_store=True), PS.replace(p_smem=False, BN=112, tma_store=True, dtype="fp16"),
           PS, PS.replace(dtype="fp16"), PS.replace(causal=True, BN=176), PS.replace(causal=True, BN=176, dtype="fp16"),
           PS.replace(head_dim=128, BN=128), PS.replace(head_dim=128, BN=112, causal=True),
           PS.replace(persistent=False, dynamic=False), PS.replace(pingpong=False),
           PS.replace(tree_max=True), PS.replace(causal=True, BN=176, tree_max=True),
           PS.replace(tree_max=True, q_double=True), PS.replace(causal=True, BN=176, tree_max=True, q_double=True),
           PS.replace(dtype="fp16", q_double=True)]
    for causal in (False, True):   # the 2-consumer d64 tile (HEURISTIC_D64's base) and the heuristic's
        h = PS.replace(BM=128, consumers=2, p_smem=False, causal=causal)
        out += [FAM.heuristic(problem(causal=causal)).replace(tree_max=True, q_double=True),
                h.replace(tree_max=True), h.replace(q_double=True), h.replace(head_dim=128, BN=176, tree_max=True),
                h.replace(head_dim=128, BN=128, q_double=True)]
    for c in out:
        c.validate(SMEM)
    return list(dict.fromkeys(out))


@needs_nvcc
def test_ptxas_no_spills_no_serialized_wgmma():
    from concurrent.futures import ThreadPoolExecutor

    from cuflash.compile import nvcc_compile

    configs = build_configs()
    chunks = [configs[i:i + 4] for i in range(0, len(configs), 4)]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        reports = [r for rs in pool.map(lambda c: nvcc_compile(c, "sm_90a", NVCC), chunks) for r in rs]
    bad = [f"{c.name}: {r}" for c, r in zip(configs, reports)
           if r.spill_stores or r.spill_loads or r.stack_bytes
           or [w for w in r.warnings if re.search(r"C75(1[0-5])\b", w) or "serialized" in w]]
    assert not bad, "\n".join(bad)
