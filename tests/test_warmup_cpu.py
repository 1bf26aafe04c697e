"""python -m cuflash warmup without a GPU (an H100 as selection sees it): for a sample of calls,
the modules the warmup compiles cover those the call's plan compiles. The call side runs the
entry points' own validation and problem building on host arrays (NumPy, torch CPU), then the
plan's own construction (cuflash.api.make_plan, cuflash.launch.Plan) up to its compile, where
cuflash.launch.get_kernels is intercepted; the warmup side is warmup.configs_to_warm. Also the
--features / --decode syntax and its errors."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import _gpu, api, decode, launch, select, warmup

torch = pytest.importorskip("torch")


class _Compiled(Exception):
    pass


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(_gpu, "arch", lambda device=0: (9, 0))
    monkeypatch.setattr(_gpu, "name", lambda device=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(_gpu, "max_smem", lambda device=0: 232448)
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)
    monkeypatch.setattr(_gpu, "require", lambda *a, **k: None)
    monkeypatch.setattr(api, "_capturing", lambda: False)
    select._chosen.clear()
    yield
    select._chosen.clear()


@pytest.fixture
def compiled(monkeypatch):
    """The configs plans compile: launch.get_kernels records its config and stops the plan."""
    seen = []

    def get_kernels(config, device):
        seen.append(config)
        raise _Compiled

    monkeypatch.setattr(launch, "get_kernels", get_kernels)
    return seen


def _plan(fn, *args):
    with pytest.raises(_Compiled):
        fn(*args)


def _qkv(b, s, h, d, hk=None, dtype=np.float16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, s, h, d)).astype(dtype)
    k = rng.standard_normal((b, s, hk or h, d)).astype(dtype)
    return q, k, k.copy()


def _dense(q, k, v, causal, deterministic=False, **feats):
    """The plans of a flash_attn_func call with features, forward and backward, as the torch
    path builds them (torch_ops._feat_entry, _feat_bwd_plan, _drop_fwd_plan, _drop_bwd_plan)."""
    for op in ("fwd", "bwd"):
        tq, tk, tv, scale, problem = api.check_qkv(q, k, v, None, causal, op, deterministic)
        b, sq, h, _ = tq.shape
        f = api.check_features(tq, feats.get("dropout_p", 0.0), feats.get("window_size", (-1, -1)),
                               feats.get("softcap", 0.0), feats.get("alibi_slopes"), causal, b, h,
                               (sq, tk.shape[1]))
        problem = api.feature_problem(problem, f) if f.features else problem
        if "dropout" in f.features:
            problem = problem.replace(dropout_p=f.dropout_p, deterministic=bool(deterministic))
        _plan(api.make_plan, problem, {}, scale, 0)


def _varlen(lens, h, d, causal, deterministic=False, **feats):
    """The plans of a flash_attn_varlen_func call (torch: varlen_torch._fast_entry's problems)."""
    from cuflash import varlen, varlen_torch

    total = sum(lens)
    q = torch.zeros(total, h, d, dtype=torch.float16)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    m = max(lens)
    checked = api.varlen_checked(q, q, q, cu, cu, m, m, feats.get("dropout_p", 0.0), None, causal,
                                 feats.get("window_size", (-1, -1)), feats.get("softcap", 0.0), None)
    _, scale, _, f, _, _, max_q, max_k = checked
    for op in ("fwd", "bwd"):
        det = deterministic and op == "bwd"
        if f.features != ("varlen",):
            p = varlen_torch._problem(op, q, q, cu, max_q, max_k, f.causal, None, f.window_size, f.softcap,
                                      f.dropout_p, det)
            _plan(api.make_plan, p, {}, scale, 0)
        else:
            _plan(varlen.get_plan, op, "fp16", len(lens), int(max_q), int(max_k), (total, total),
                  tuple(q.shape), tuple(q.shape), {}, float(scale), bool(f.causal), det, 0)


def _kvcache(batch, ctx, page, h, hk, d, causal, append=True, rotary=0):
    """The plan of a flash_attn_with_kvcache call (decode._gpu_entry: check_kvcache, call_config,
    Plan) on NumPy arrays."""
    rng = np.random.default_rng(1)
    if page:
        pages = -(-ctx // page)
        cache = np.zeros((batch * pages, page, hk, d), np.float16)
        table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    else:
        cache, table = np.zeros((batch, ctx, hk, d), np.float16), None
    q = rng.standard_normal((batch, 1, h, d)).astype(np.float16)
    k = v = rng.standard_normal((batch, 1, hk, d)).astype(np.float16) if append else None
    cos = sin = np.ones((ctx + 1, rotary // 2), np.float16) if rotary else None
    lens = np.full(batch, ctx // 2, np.int32)
    call = decode.check_kvcache(q, cache, cache, k, v, cos, sin, lens, None, None, table, None, causal,
                                (-1, -1), 0.0, False, None, 0)
    problem = call.problem("fp16")
    family, cfg = decode.call_config(problem, 0, page, call.num_splits)
    _plan(launch.Plan, family, cfg, problem, {}, call.softmax_scale, 0)


def _covers(warmed, seen):
    have = warmup.modules(warmed)
    missing = [c.name for key, c in warmup.modules(seen).items() if key not in have]
    assert not missing, missing


@pytest.mark.parametrize("det", [False, True], ids=["nondeterministic", "deterministic"])
def test_feature_mixes_and_varlen_are_warmed(h100, compiled, det):
    """One model's calls (deterministic or not throughout): window + softcap, ALiBi + dropout,
    the plain call, varlen plain and with window + softcap, at three lengths."""
    slopes = np.linspace(0.1, 0.9, 16).astype(np.float32)
    for s in (700, 3000, 9000):
        q, k, v = _qkv(2, s, 16, 128, hk=4)
        _dense(q, k, v, True, det, window_size=(1024, 0), softcap=30.0)
        _dense(q, k, v, False, det, window_size=(1024, 1024), softcap=50.0)
        _dense(q, k, v, True, det, alibi_slopes=slopes, dropout_p=0.1)
        _dense(q, k, v, True, det)
        _varlen([s, s // 3 + 1], 4, 128, True, det)
        _varlen([s // 2, s], 4, 128, True, det, window_size=(1024, 0), softcap=30.0)
    assert len(compiled) == 3 * 6 * 2   # every call planned, forward and backward
    args = (["fwd", "bwd"], ["fp16"], [128], [False, True])
    mixes = warmup.parse_features("window+softcap,alibi+dropout")
    _covers(warmup.configs_to_warm(*args, features=mixes, deterministic=det, varlen=True), compiled)
    # without the options, or with the other backward, kernels are missing
    for kw in ({}, {"features": mixes, "varlen": True, "deterministic": not det}):
        with pytest.raises(AssertionError):
            _covers(warmup.configs_to_warm(*args, **kw), compiled)


def test_decode_calls_are_warmed(h100, compiled):
    calls = warmup.decode_calls("batch=1..8,ctx=8k..128k,page=0,16,256,heads=32:8,with=append+rotary,none")
    for batch, ctx, page in ((1, 8192, 0), (1, 131072, 0), (8, 32768, 0), (4, 98304, 0), (1, 16384, 16),
                             (3, 65536, 16), (8, 8192, 256), (1, 49152, 256)):
        _kvcache(batch, ctx, page, 32, 8, 128, True, append=True, rotary=64)
        _kvcache(batch, ctx, page, 32, 8, 128, True, append=False)
    assert len(compiled) == 16
    warmed = warmup.configs_to_warm([], ["fp16"], [128], [True], decode=calls)
    _covers(warmed, compiled)
    assert warmup.configs_to_warm([], ["fp16"], [128], [False], decode=calls.__class__(
        **{**calls.__dict__, "causal": (True,)})) == warmed   # the spec's causal over --causal
    assert {c.family for c in warmed} == {"decode_splitkv"}
    contiguous = warmup.decode_calls("batch=1..8,ctx=8k..128k,page=0,with=append+rotary,none")
    with pytest.raises(AssertionError):   # the paged calls' kernels are others
        _covers(warmup.configs_to_warm([], ["fp16"], [128], [True], decode=contiguous), compiled)


def test_parse_features():
    assert warmup.parse_features("window+softcap, alibi+dropout,softcap+window") == [
        ("softcap", "window"), ("alibi", "dropout")]
    assert warmup.parse_features("all") == [(f,) for f in warmup.FEATURES]
    assert warmup.parse_features("") == []
    with pytest.raises(ValueError, match="unknown feature 'rope'"):
        warmup.parse_features("window+rope")


def test_feature_problems_mix_values():
    (p,) = warmup.feature_problems("fwd", "bf16", 128, True, "window+alibi", 4096)
    assert p.features == ("alibi", "window") and p.window == (warmup.WINDOW, 0)
    # the window dropped where it covers every key: ALiBi alone remains
    (p,) = warmup.feature_problems("fwd", "bf16", 128, True, "window+alibi", 1024)
    assert p.features == ("alibi",)
    caps = warmup.feature_problems("bwd", "bf16", 128, False, ("softcap", "dropout"), 2048, deterministic=True)
    assert [(q.softcap, q.dropout_p, q.deterministic) for q in caps] == [(30.0, 0.1, True), (50.0, 0.1, True)]
    (v,) = warmup.feature_problems("bwd", "bf16", 128, True, "varlen+window", 512, deterministic=True)
    assert v.features == ("varlen", "window") and v.window == (warmup.WINDOW, 0) and v.deterministic


def test_decode_syntax():
    c = warmup.decode_calls("batch=1..4,ctx=8k..32k,page=0,16,256")
    assert c.batch == (1, 2, 3, 4) and c.page == (0, 16, 256)
    assert c.ctx == (8192, 12288, 16384, 24576, 32768)
    c = warmup.decode_calls("batch=2,16, ctx=20000,40k, heads=16:2,8, q=1..2, with=none,append+rotary")
    assert c.batch == (2, 16) and c.ctx == (20000, 40960) and c.heads == ((16, 2), (8, 8))
    assert c.q == (1, 2) and c.with_ == ((), ("append", "rotary")) and c.causal is None
    assert warmup.decode_calls("causal=no").causal == (False,)
    assert warmup.decode_problems(warmup.decode_calls("ctx=1000,page=256,with=none"), "bf16", 128, True)[0][0] \
        .seqlen_k == 1024   # whole pages
    for bad, match in (("size=3", "unknown key 'size'"), ("8k", "needs a key"), ("batch=0", "batch must be >= 1"),
                       ("heads=32:5", "HKV >= 1 dividing H"), ("with=append+paged_kv", "unknown feature"),
                       ("ctx=9k..8k", "lo <= hi"), ("causal=maybe", "causal must be"), ("batch=1,batch=2", "given twice"), ("batch=x", "decode:")):
        with pytest.raises(ValueError, match=match):
            warmup.decode_calls(bad)


def test_helper_modules_are_the_calls(monkeypatch):
    """--helpers: the modules warmed are those the cross-entropy and rotary plans load (the same
    source and name expressions: CuPy's disk-cache key), for bf16 / fp16 and fp32."""
    from cuflash import compile as compile_mod
    from cuflash import cross_entropy, rotary

    assert warmup.parse_helpers("all") == list(warmup.HELPERS)
    assert warmup.parse_helpers("rotary, cross_entropy,rotary") == ["rotary", "cross_entropy"]
    with pytest.raises(ValueError, match="unknown helper 'layernorm'"):
        warmup.parse_helpers("layernorm")
    mods = warmup.helper_modules(["cross_entropy", "rotary"], ["bf16", "fp16"])
    assert all(isinstance(m, compile_mod.HelperModule) for m in mods)
    assert len(mods) == 3 + 3 * 2 and len(set(mods)) == len(mods)
    assert compile_mod.HelperModule("cross_entropy", cross_entropy.kernel_names(torch.bfloat16)) in mods
    assert compile_mod.HelperModule("rotary", rotary.kernel_names(torch.float16, torch.float16, True)) in mods
    assert "cross_entropy: cuflash::cross_entropy_fwd<cuflash::bf16" in mods[0].name
    # what the plans ask get_helper_functions for
    asked = []

    def fake(source, names, device):
        asked.append(compile_mod.HelperModule(source, tuple(names)))
        raise _Compiled

    monkeypatch.setattr(compile_mod, "get_helper_functions", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 132}))
    logits = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(_Compiled):
        cross_entropy._Plan(logits, torch.zeros(4, dtype=torch.int64), 0.0, 1.0, 0.0, -100, 0, 64)
    x = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    cos = torch.zeros(8, 8, dtype=torch.float16)
    with pytest.raises(_Compiled):
        rotary._Plan(x, cos, (1, 8, 16), False, 0, True, False, False)
    assert asked and all(m in mods for m in asked)
    # precompile's worker takes a HelperModule through get_helper_kernels
    loaded = []
    monkeypatch.setattr(compile_mod, "get_helper_kernels", lambda src, names, dev: loaded.append((src, names)))
    cfg, seconds, error = compile_mod._compile_one((mods[0], 0))
    assert cfg is mods[0] and error == "" and loaded == [(mods[0].source, mods[0].names)]


def test_cli_errors_before_the_gpu(capsys):
    for argv, match in ((["--helpers", "cross_entropy,ln"], "--helpers: unknown helper 'ln'"),
                        (["--features", "window+rope"], "--features: unknown feature 'rope'"),
                        (["--decode", "ctx=8k,size=1"], "--decode: unknown key 'size'")):
        with pytest.raises(SystemExit) as e:
            warmup.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err
