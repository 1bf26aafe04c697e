"""sm90_fwd's lazy_rescale on plain d256 calls (HEURISTIC_LAZY, class_switches: the heuristic's and the tuned
entries' configs), rag_keys (kRagKeys: the ragged last K/V block's P V at its own k16 steps), prefetch (kPrefetch:
the next tile's Q into L2 by TMA) and even_waves (the static persistent grid at equal
tile counts) without a GPU: the fields' rules, names, template arguments and encoding (the plain kernel's
name unchanged), for_problem resolving rag_keys=-1 to the call's ragged block, even_waves' grid, and the
nvcc build (sm_90a) without spills or serialized wgmma."""
import os
import sys

import pytest

from cuflash.families.sm90_fwd import even_waves_grid
from cuflash.problem import Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sm90_tile_overlap_cpu import FAM, PLAIN, needs_nvcc  # noqa: E402  (PLAIN: the d256 2k tile)

RAG = PLAIN.replace(rag_keys=48)
EV = PLAIN.replace(even_waves=True)
PF = PLAIN.replace(prefetch=True)


def cell(seqlen_k, causal=False, **kw):
    return Problem("fwd", "bf16", 8, 2048, seqlen_k, 8, 8, 256, causal, **kw)


def test_rag_keys_name_template_and_encoding():
    assert RAG.validate(227 * 1024) is RAG and RAG.name == PLAIN.name + "_rag48"
    assert PLAIN.kernel_name() == "cuflash::sm90_fwd<128, 80, 2, 2, false, true, 256, cuflash::bf16, false, false, false, false>"
    assert RAG.kernel_name().endswith(", false, 0, 48>") and RAG.template_args()[-4] == 48
    assert PLAIN.template_args()[-4] == 0 and PLAIN.template_args()[-3] is False
    assert "rag_keys" not in FAM.encode(PLAIN) and FAM.encode(RAG).endswith(",rag_keys=48")
    assert FAM.decode(FAM.encode(RAG), "bf16", False) == RAG
    assert FAM.decode(FAM.encode(PLAIN.replace(rag_keys=-1)), "bf16", False).rag_keys == -1
    assert "rag_keys" not in FAM.space


@pytest.mark.parametrize("change,pattern", [
    (dict(rag_keys=40), r"rag_keys must be 0, -1"), (dict(rag_keys=80), r"rag_keys must be 0, -1"),
    (dict(causal=True), r"plain non-causal"), (dict(softcap=True), r"plain non-causal"),
    (dict(varlen=True), r"plain non-causal"), (dict(stream_tail=True), r"plain non-causal"),
    (dict(tile_overlap=True), r"plain non-causal"), (dict(pv_overlap=True), r"plain non-causal")])
def test_rag_keys_rules(change, pattern):
    import re

    why = RAG.replace(**change).problems(227 * 1024)
    assert any(re.search(pattern, w) for w in why), why


def test_rag_keys_allowed_with():
    for change in (dict(lazy_rescale=True), dict(dynamic=True), dict(even_waves=True), dict(tree_max=True),
                   dict(dtype="fp16"), dict(rag_keys=-1), dict(rag_keys=64)):
        assert RAG.replace(**change).problems(227 * 1024) == [], change


@pytest.mark.parametrize("seqlen_k,want", [(2048, 48), (4096, 16), (8192, 32), (16384, 64), (1024, 64),
                                           (2000, 0), (2049, 0), (17, 0), (48, 48)])
def test_for_problem_resolves_the_calls_ragged_block(seqlen_k, want):
    for cfg in (PLAIN.replace(rag_keys=-1), RAG):
        assert FAM.for_problem(cfg, cell(seqlen_k)).rag_keys == want


def test_for_problem_drops_it():
    auto = PLAIN.replace(rag_keys=-1)
    assert FAM.for_problem(auto.replace(causal=True), cell(2048, True)).rag_keys == 0
    assert FAM.for_problem(auto, cell(2048, features=("softcap",), softcap=30.0)).rag_keys == 0
    assert FAM.for_problem(auto.replace(stream_tail=True), cell(2048)).rag_keys == 0
    assert FAM.for_problem(PLAIN, cell(2048)).rag_keys == 0     # off stays off


def test_even_waves_grid():
    assert even_waves_grid(1024, 132) == 128 and even_waves_grid(2048, 132) == 128
    assert even_waves_grid(100, 132) == 100 and even_waves_grid(133, 132) == 67 and even_waves_grid(1, 132) == 1
    for tiles in range(1, 2000, 7):
        g = even_waves_grid(tiles, 132)
        assert g <= 132 and -(-tiles // g) == -(-tiles // 132), tiles   # the same waves, no more CTAs
    p = cell(2048)
    assert FAM.launches(EV, p, 132)[0].grid == (128, 1, 1) and FAM.launches(PLAIN, p, 132)[0].grid == (132, 1, 1)


def test_even_waves_name_encoding_rules():
    assert EV.validate(227 * 1024) is EV and EV.name == PLAIN.name + "_ev"
    assert EV.kernel_name() == PLAIN.kernel_name() and EV.template_args() == PLAIN.template_args()
    assert "even_waves" not in FAM.encode(PLAIN) and FAM.encode(EV).endswith(",even_waves=1")
    assert FAM.decode(FAM.encode(EV), "bf16", False) == EV
    for change in (dict(dynamic=True), dict(persistent=False), dict(stream_tail=True), dict(cluster=True)):
        why = EV.replace(**change).problems(227 * 1024)
        assert any("even_waves sizes the static persistent grid" in w for w in why), (change, why)


def test_prefetch_name_template_encoding_rules():
    assert PF.validate(227 * 1024) is PF and PF.name == PLAIN.name + "_pf"
    assert PF.kernel_name().endswith(", 0, 0, true>") and PF.template_args()[-3] is True
    assert "prefetch" not in FAM.encode(PLAIN) and FAM.encode(PF).endswith(",prefetch=1")
    assert FAM.decode(FAM.encode(PF), "bf16", False) == PF and "prefetch" not in FAM.space
    for change in (dict(dynamic=True), dict(persistent=False), dict(stream_tail=True), dict(cluster=True),
                   dict(varlen=True)):
        why = PF.replace(**change).problems(227 * 1024)
        assert any("prefetch needs the static persistent schedule" in w for w in why), (change, why)
    for change in (dict(tile_overlap=True), dict(lazy_rescale=True, rag_keys=48), dict(causal=True),
                   dict(head_dim=128, BN=176, pingpong=True), dict(softcap=True)):
        assert PF.replace(**change).problems(227 * 1024) == [], change
    assert FAM.for_problem(PF, cell(2048)) == PF
    varlen = Problem("fwd", "bf16", 8, 2048, 2048, 8, 8, 256, False, features=("varlen",))
    assert FAM.for_problem(PF, varlen).prefetch is False


def selected(dtype, d, causal, s, config=None):
    from cuflash import select

    p = Problem.fa_convention("fwd", dtype, d, causal, s)
    return select.choose(p, (9, 0), "NVIDIA H100 80GB HBM3", 227 * 1024, config=config)[1]


@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescale_for_d256_plain_calls(causal):
    for dtype in ("bf16", "fp16"):
        for s in (2048, 4096, 8192, 16384):
            cfg = selected(dtype, 256, causal, s)       # (the tuned entries' configs, through make)
            assert cfg.lazy_rescale and not cfg.stream_tail and cfg.problems(227 * 1024) == [], cfg.name
            p = Problem.fa_convention("fwd", dtype, 256, causal, s)
            heur = FAM.for_problem(FAM.heuristic(p), p)
            assert heur.lazy_rescale and not heur.stream_tail, heur.name
    assert not selected("bf16", 128, causal, 16384).lazy_rescale        # (measured slower at d128)
    assert not selected("bf16", 256, causal, 2048, config=PLAIN.replace(causal=causal)).lazy_rescale  # given
    p = Problem("fwd", "bf16", 8, 2048, 2048, 8, 8, 256, causal, features=("window",), window=(256, 0))
    cfg = PLAIN.replace(causal=causal, window=True)
    assert FAM.class_switches(cfg, p) is cfg                            # (feature calls: their own rules)


@needs_nvcc
def test_selected_d256_kernels_compile_without_spills():
    from cuflash.compile import nvcc_compile

    cfgs = {c.kernel_name(): c for c in (selected(dt, 256, causal, s) for dt in ("bf16", "fp16")
                                         for causal in (False, True) for s in (2048, 8192))}
    for r in nvcc_compile(list(cfgs.values()), "sm_90a"):
        assert r.spill_stores == 0 and r.spill_loads == 0 and not r.warnings, r


@needs_nvcc
def test_rag_keys_kernels_compile_without_spills():
    from cuflash.compile import nvcc_compile

    cfgs = [RAG, RAG.replace(lazy_rescale=True), RAG.replace(rag_keys=16, dtype="fp16"), RAG.replace(rag_keys=64),
            PF, PF.replace(lazy_rescale=True, rag_keys=48), PF.replace(tile_overlap=True),
            PF.replace(head_dim=128, BN=176, pingpong=True)]
    for r in nvcc_compile(cfgs, "sm_90a"):
        assert r.spill_stores == 0 and r.spill_loads == 0 and not r.warnings, r
