"""REGS_CLUSTER_PAIRS (session 27, dec19): a chosen regs call of batch >= 2 whose split rule gives exactly 2
splits runs them as one cluster of 2 CTAs (regs_cluster 2, no fused combine), decided per call in
cuflash.decode.call_config once the device's SM count is known (DecodeSplitKV.pair_cluster). CPU only: a faked
H100 (132 SMs)."""
import pytest

from cuflash import _gpu, decode, select
from cuflash.families import decode_splitkv as mod
from cuflash.problem import Problem
from cuflash.registry import get

FAM = get("decode_splitkv")


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (9, 0))
    monkeypatch.setattr(_gpu, "name", lambda device=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: 232448)
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    select._chosen.clear()
    yield
    select._chosen.clear()


def _cfg(batch, ctx, page=0, hk=8, h=32, num_splits=0, d=128):
    p = Problem("decode", "bf16", batch, 1, ctx, h, hk, d, False, False, ("paged_kv",) if page else ())
    return decode.call_config(p, 0, page, num_splits)[1]


def test_pairs_where_two_splits(h100):
    """8 x 8 KV heads (64 groups on 132 SMs: 2 splits) at every context: the cluster of 2; 4 x 8 (4 splits),
    16 x 8 and 32 x 8 (1 split) keep theirs; batch 16 x 4 KV heads (64 groups) pairs too."""
    for ctx in (4096, 8192, 32768, 131072, 1000):
        c = _cfg(8, ctx)
        assert (c.regs_cluster, c.splits, c.fused_combine, c.light_fence) == (2, 2, False, False), (ctx, c.name)
        assert not c.problems(232448), c.name
    assert _cfg(16, 32768, hk=4).regs_cluster == 2
    for batch, splits in ((4, 4), (16, 1), (32, 1)):
        c = _cfg(batch, 32768)
        assert c.regs_cluster == 0 and c.splits == splits and c.fused_combine, (batch, c.name)


def test_pairs_not_batch1_or_given_splits(h100, monkeypatch):
    """Paged caches pair too (REGS_CLUSTER_PAIRS_PAGED, the page table kept); batch 1 (dec18's rules), a caller's
    num_splits=2, head dims the regs kernel does not run, and the switches off keep the fused combine."""
    for page in (16, 256):
        c = _cfg(8, 32768, page=page)
        assert (c.regs_cluster, c.splits, c.fused_combine, c.regs_page_table) == (2, 2, False, 1), c.name
    assert _cfg(1, 32768).regs_cluster == 0
    c = _cfg(8, 32768, num_splits=2)
    assert c.regs_cluster == 0 and c.fused_combine, c.name
    assert _cfg(8, 32768, d=96).regs_cluster == 0
    monkeypatch.setattr(mod, "REGS_CLUSTER_PAIRS_PAGED", False)
    c = _cfg(8, 32768, page=256)
    assert c.regs_cluster == 0 and c.splits == 2 and c.fused_combine, c.name
    assert _cfg(8, 32768).regs_cluster == 2
    monkeypatch.setattr(mod, "REGS_CLUSTER_PAIRS", False)
    c = _cfg(8, 32768)
    assert c.regs_cluster == 0 and c.splits == 2 and c.fused_combine, c.name


def test_pair_cluster_method():
    """pair_cluster: only a regs config with the fused combine, no pdl, at exactly 2 splits and batch >= 2."""
    p = Problem("decode", "bf16", 8, 1, 32768, 32, 8, 128, False, False, ())
    heur = FAM.heuristic(p, (9, 0))
    assert heur.regs and heur.fused_combine
    assert FAM.pair_cluster(heur, p, 2).regs_cluster == 2
    assert FAM.pair_cluster(heur, p, 3) == heur and FAM.pair_cluster(heur, p, 1) == heur
    assert FAM.pair_cluster(heur.replace(pdl=1), p, 2).regs_cluster == 0
    assert FAM.pair_cluster(heur.replace(regs=0), p, 2).regs_cluster == 0
    assert FAM.pair_cluster(heur, p.replace(batch=1), 2).regs_cluster == 0


def test_staged_switch_keeps_a_valid_config(h100, monkeypatch):
    """Review (session 27): with the staged ring switched on for every call, a 2-split batch-8 call keeps its
    staged config (no pair: regs_staged and regs_cluster are not built together) instead of raising."""
    monkeypatch.setattr(mod, "REGS_STAGED_DEFAULT", 1)
    c = _cfg(8, 32768)
    assert c.regs_staged and not c.regs_cluster and not c.problems(232448), c.name


def test_regs_fallback_to_another_head_dim_is_valid():
    """Review (session 27): a chosen batch-1 regs config (separate early combine, pdl) met by a call of another head
    dim falls back to the cp.async loop without the regs kernel's early separate combine."""
    p = Problem("decode", "bf16", 1, 1, 4096, 32, 8, 128, False, False, ())
    cfg = FAM.heuristic(p, (9, 0))
    assert cfg.regs and cfg.early_merge and not cfg.fused_combine, cfg.name
    out = FAM.call_config(cfg, p.replace(head_dim=96), (9, 0), 0, chosen=True)
    assert not out.regs and not out.early_merge and not out.problems(232448), out.name
