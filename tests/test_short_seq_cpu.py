"""Issue 12's short-sequence selection without a GPU: sm90_fwd's short-key K/V block width (short_keys_bn, the
heuristic's for plain non-causal head-dim-64 calls with at most SHORT_KEYS_MAX keys) with SHORT_KEYS_FIELDS, the
short causal schedule (SHORT_CAUSAL_FIELDS), select.choose_on_device's per-length cache for short calls
(SHORT_EXACT), warmup's short lengths, and sm90_bwd's wide_epi at head dim 64, causal or not (HEURISTIC_WIDE_EPI). GPU: tests/test_short_seq_gpu.py, tests/short_seq_sanitize.py; timing:
tests/short_seq_timing.py."""
import pytest

from cuflash import _gpu, registry, select, warmup
from cuflash.families import sm90_bwd, sm90_fwd
from cuflash.problem import Problem

FWD, BWD = registry.get("sm90_fwd"), registry.get("sm90_bwd")


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (9, 0))
    monkeypatch.setattr(_gpu, "name", lambda device=0: "NVIDIA H200")
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: 232448)
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    select.clear_cache()
    yield
    select.clear_cache()


def fwd(s, causal=False, dtype="bf16", d=64, **kw):
    return Problem("fwd", dtype, 4, s, s, 12, 12, d, causal, **kw)


def test_short_keys_bn():
    want = {1: 112, 17: 112, 112: 112, 113: 128, 128: 128, 160: 160, 197: 112, 257: 144, 300: 160, 384: 192,
            400: 144, 512: 128, 577: 160, 700: 176, 768: 192}
    assert {s: sm90_fwd.short_keys_bn(s) for s in want} == want
    for s in range(1, sm90_fwd.SHORT_KEYS_MAX + 1):   # never more padded keys than BN 192's
        bn = sm90_fwd.short_keys_bn(s)
        assert -(-s // bn) * bn <= -(-s // 192) * 192 and bn in sm90_fwd.SHORT_KEYS_BNS


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_heuristic_short_keys(dtype):
    for s in (128, 197, 257, 512, 577, 768):
        cfg = FWD.heuristic(fwd(s, dtype=dtype))
        assert cfg.BN == sm90_fwd.short_keys_bn(s) and (cfg.BM, cfg.consumers) == (128, 2), cfg.name
        assert cfg.persistent and not cfg.dynamic and not cfg.problems(232448), cfg.name
        assert cfg.tma_store and not cfg.q_double and cfg.pingpong, cfg.name   # SHORT_KEYS_FIELDS
    base = FWD.heuristic(fwd(1024, dtype=dtype))
    assert base.BN == 192 and not base.tma_store and FWD.heuristic(fwd(769, dtype=dtype)) == base
    for p in (fwd(197, True, dtype), fwd(197, dtype=dtype, features=("softcap",), softcap=30.0), fwd(197, d=128)):
        assert FWD.heuristic(p).BN != sm90_fwd.short_keys_bn(197) or p.head_dim != 64, FWD.heuristic(p).name
    assert not FWD.heuristic(fwd(197, dtype=dtype, features=("softcap",), softcap=30.0)).tma_store


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_heuristic_short_causal(dtype):
    """Causal d64 calls below HEURISTIC_D64_MIN_BUCKET: BN 128, q_double, tma_store (SHORT_CAUSAL_FIELDS) on the
    2-consumer dynamic tile; from the 2048 bucket on HEURISTIC_D64's 3-consumer tile as before; not with features,
    varlen or another head dim."""
    for s in (1, 17, 113, 128, 197, 256, 512, 1024, 1448):
        cfg = FWD.heuristic(fwd(s, True, dtype))
        assert (cfg.BM, cfg.BN, cfg.consumers, cfg.pingpong) == (128, 128, 2, True), cfg.name
        assert cfg.persistent and cfg.dynamic and cfg.q_double and cfg.tma_store, cfg.name
        assert not cfg.problems(232448), (cfg.name, cfg.problems(232448))
    for s in (1449, 2048, 4096):
        cfg = FWD.heuristic(fwd(s, True, dtype))
        assert (cfg.BM, cfg.consumers) == (192, 3) and not cfg.tma_store, cfg.name
    for p in (fwd(512, True, dtype, features=("window",), window=(64, 0)), fwd(512, True, d=128)):
        cfg = FWD.heuristic(p)
        assert not (cfg.q_double and cfg.tma_store and cfg.BN == 128 and cfg.head_dim == 64), cfg.name


def test_choose_on_device_per_short_length(h200):
    """Short calls are cached per length (their BN differs within a bucket); longer ones per bucket."""
    got = {s: select.choose_on_device(fwd(s), 0)[1].BN for s in (128, 197, 512, 577)}
    assert got == {128: 128, 197: 112, 512: 128, 577: 160}
    assert select.choose_on_device(fwd(197), 0)[1].BN == 112   # (from the cache)
    a, b = select.choose_on_device(fwd(2048), 0), select.choose_on_device(fwd(2500), 0)
    assert a is b   # one bucket, one cached choice


def test_warmup_warms_the_short_widths(h200):
    names = {c.name for c in warmup.configs_to_warm(["fwd"], ["bf16"], [64], [False])}
    for bn in sm90_fwd.SHORT_KEYS_BNS:
        assert f"sm90fwd_bf16_d64_full_BM128_BN{bn}_s2_c2_pp_persist_tmao" in names, (bn, sorted(names))
    causal = {c.name for c in warmup.configs_to_warm(["fwd"], ["bf16"], [64], [True])}
    assert "sm90fwd_bf16_d64_causal_BM128_BN128_s2_c2_pp_persist_dyn_tmao_q2" in causal, sorted(causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_wide_epi_d64(dtype):
    def heur(s=197, causal=False, heads=(12, 12), det=False):
        p = Problem("bwd", dtype, 4, s, s, heads[0], heads[1], 64, causal, det)
        return BWD.for_problem(BWD.heuristic(p, (9, 0)), p)

    assert (64, False, dtype) in sm90_bwd.HEURISTIC_WIDE_EPI
    for s in (128, 197, 512, 577, 2048):
        assert heur(s).wide_epi, heur(s).name
    assert sm90_bwd.WIDE_EPI_MAX_SEQLEN_BY[(64, False, dtype)] == 2048 and not heur(8192).wide_epi   # (8k: no faster)
    assert not heur(heads=(12, 4)).wide_epi and not heur(det=True).wide_epi
    # causal too (session 31), up to the same cap
    assert (64, True, dtype) in sm90_bwd.HEURISTIC_WIDE_EPI
    assert all(heur(s, causal=True).wide_epi for s in (128, 512, 1024, 2048)) and not heur(4096, causal=True).wide_epi
