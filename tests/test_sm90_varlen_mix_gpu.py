"""Varlen feature mixes on the Hopper kernels (issue 12, session 25): sm90_fwd / sm90_bwd built with
varlen and two or more of window, softcap, ALiBi and dropout (VARLEN_FEATURES), and the features at
head dims 65..96 (the d128 backward kernel, zero-filled columns), the FlashAttention way.

Each case lets selection run the sm90 kernel whatever rank() says today (the rank tables
VARLEN_SMALL_D_FEATURES / VARLEN_D128_FEATURES patched to hold every set: the kernels' numbers are
checked here, their speed in tests/sm90_varlen_bwd_features_timing.py) and asserts which family runs:
sm90_fwd / sm90_bwd wherever supports() takes the mix, fa2 elsewhere. Every sequence of the packed
batch (lengths with 0 and 1, s_q != s_k) is compared with the same features and dropout's keep mask
(an explicit seed: cuflash.dropout.keep_mask of batch index b) on that sequence alone: the float64
reference and the same computation in the inputs' low precision (test_dropmix_gpu.mix_attention); the
output within 2x the low-precision error, gradients within 3x (plus test_dropout_gpu's floor), outputs
poisoned (NaN) before each launch; with dropout S_dmask's sign is the keep mask where P > 0 and 0
outside the window. GQA / MQA / MHA, causal and not.

Compile count: a forward and a backward per case (bf16 cases share tests/sm90_varlen_bwd_features_timing.py's
kernels).
"""
import math

import pytest

import cuflash

from conftest import torch_dtype  # noqa: E402
from test_dropmix_gpu import check_varlen, slopes_of  # noqa: E402
from test_varlen_gpu import LENS, cu_seqlens, packed_inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

P_DROP = 0.17
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
ALL_SETS = frozenset(tuple(sorted(f for i, f in enumerate(("alibi", "dropout", "softcap", "window")) if m >> i & 1))
                     for m in range(1, 16))

# (id, features, dtype, head dim, causal, heads[, deterministic])
CASES = [
    # head dim 128: the pairs with ALiBi and the dropout mixes the d128 backward builds (dropout_mix:
    # not a window with softcap or ALiBi); the forward of softcap + dropout at d128: fa2_fwd
    ("alibi_window_causal_d128_gqa", ("alibi", "window"), "bf16", 128, True, "gqa"),
    ("alibi_softcap_full_d128_mqa", ("alibi", "softcap"), "bf16", 128, False, "mqa"),
    ("dropout_window_full_d128_gqa", ("dropout", "window"), "bf16", 128, False, "gqa"),
    ("dropout_softcap_causal_d128_mha", ("dropout", "softcap"), "bf16", 128, True, "mha"),
    ("alibi_dropout_causal_d128_gqa", ("alibi", "dropout"), "bf16", 128, True, "gqa"),
    ("alibi_dropout_softcap_full_d128_gqa", ("alibi", "dropout", "softcap"), "bf16", 128, False, "gqa"),
    ("alibi_dropout_window_full_fp16_d128_mqa", ("alibi", "dropout", "window"), "fp16", 128, False, "mqa"),
    # head dims 65..96: one feature (the d128 backward kernel with zero-filled columns), and a mix
    ("window_causal_d96_gqa", ("window",), "bf16", 96, True, "gqa"),
    ("softcap_full_d96_mha", ("softcap",), "bf16", 96, False, "mha"),
    ("alibi_causal_d80_mqa", ("alibi",), "bf16", 80, True, "mqa"),
    ("dropout_full_d96_gqa", ("dropout",), "bf16", 96, False, "gqa"),
    ("alibi_softcap_window_causal_d96_gqa", ("alibi", "softcap", "window"), "bf16", 96, True, "gqa"),
    ("alibi_window_full_d96_gqa", ("alibi", "window"), "bf16", 96, False, "gqa"),
    ("softcap_window_causal_d96_mqa", ("softcap", "window"), "bf16", 96, True, "mqa"),
    ("dropout_softcap_full_d96_gqa", ("dropout", "softcap"), "bf16", 96, False, "gqa"),
    ("alibi_dropout_causal_d80_gqa", ("alibi", "dropout"), "bf16", 80, True, "gqa"),
    ("dropout_window_causal_d96_mha", ("dropout", "window"), "bf16", 96, True, "mha"),
    # head dim 64: every mix (dropout_mix takes them all there)
    ("alibi_window_full_d64_gqa", ("alibi", "window"), "bf16", 64, False, "gqa"),
    ("alibi_softcap_causal_d64_mha", ("alibi", "softcap"), "bf16", 64, True, "mha"),
    ("softcap_window_full_d64_mqa", ("softcap", "window"), "bf16", 64, False, "mqa"),
    ("alibi_softcap_window_causal_d64_gqa", ("alibi", "softcap", "window"), "bf16", 64, True, "gqa"),
    ("dropout_window_causal_d64_gqa", ("dropout", "window"), "bf16", 64, True, "gqa"),
    ("dropout_softcap_full_d64_mha", ("dropout", "softcap"), "bf16", 64, False, "mha"),
    ("alibi_dropout_full_d64_gqa", ("alibi", "dropout"), "bf16", 64, False, "gqa"),
    ("alibi_dropout_softcap_causal_d64_mqa", ("alibi", "dropout", "softcap"), "bf16", 64, True, "mqa"),
    ("alibi_dropout_window_full_d64_gqa", ("alibi", "dropout", "window"), "bf16", 64, False, "gqa"),
    ("dropout_softcap_window_causal_d64_gqa", ("dropout", "softcap", "window"), "bf16", 64, True, "gqa"),
    ("all_full_fp16_d64_gqa", ("alibi", "dropout", "softcap", "window"), "fp16", 64, False, "gqa"),
    ("all_causal_d48_mha", ("alibi", "dropout", "softcap", "window"), "bf16", 48, True, "mha"),
    # deterministic (d64 only: the d128 kernel has none with varlen), bitwise reproducible too
    ("alibi_softcap_window_causal_d64_det_gqa", ("alibi", "softcap", "window"), "bf16", 64, True, "gqa", True),
    ("alibi_window_full_d64_det_mqa", ("alibi", "window"), "fp16", 64, False, "mqa", True),
]


@pytest.fixture
def sm90_ranked(monkeypatch):
    """Selection ranks sm90_bwd above fa2_bwd for every varlen set (the kernels under test)."""
    from cuflash import select
    from cuflash.families import sm90_bwd

    monkeypatch.setattr(sm90_bwd, "VARLEN_SMALL_D_FEATURES", {64: ALL_SETS, 96: ALL_SETS})
    monkeypatch.setattr(sm90_bwd, "VARLEN_D128_FEATURES", ALL_SETS)
    monkeypatch.setattr(select, "_chosen", {})


def families_run(problem_args):
    """{op: the family selection runs} for a varlen call with these features on this GPU."""
    from cuflash import _gpu, registry, select, varlen

    out = {}
    for op in ("fwd", "bwd"):
        p = varlen.features_problem(op, *problem_args)
        fam = select.choose(p, _gpu.arch(), _gpu.name(), _gpu.max_smem())[0]
        want = "sm90_" + op if not registry.get("sm90_" + op).supports(_gpu.arch(), p) else "fa2_" + op
        assert fam.name == want, f"{op}: selection runs {fam.name}, supports() says {want}"
        out[op] = fam.name
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_varlen_mix_forward_backward(case, sm90_ranked):
    import torch

    name, feats, dtype, d, causal, heads = case[:6]
    det = case[6] if len(case) > 6 else False
    lens_q, lens_k = LENS
    h, hkv = HEADS[heads]
    t = torch_dtype(dtype)
    q, k, v, dout = packed_inputs(lens_q, lens_k, h, hkv, d, t, seed=len(name))
    window = ((37, -1) if causal else (50, 20)) if "window" in feats else (-1, -1)
    softcap = 10.0 if "softcap" in feats else 0.0
    p = P_DROP if "dropout" in feats else 0.0
    slopes = slopes_of(("bh" if causal else "h") if "alibi" in feats else None, len(lens_q), h)
    seed = (1234, 5)
    scale = 1 / math.sqrt(d)
    ran = families_run((dtype, len(lens_q), max(lens_q), max(lens_k), h, hkv, d, causal, window, softcap,
                        None if slopes is None else slopes.ndim == 2, p, det))
    print(name, ran)

    def call():
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse, s_dmask = cuflash.flash_attn_varlen_func(
            qg, kg, vg, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k), p, causal=causal,
            window_size=window, softcap=softcap, alibi_slopes=slopes, deterministic=det, return_attn_probs=True,
            **(dict(dropout_seed=seed) if p else {}))
        return (out, lse, *torch.autograd.grad(out, (qg, kg, vg), dout)), s_dmask

    (out, lse, dq, dk, dv), s_dmask = call()
    if det:
        again = call()[0]
        assert all(torch.equal(a, b) for a, b in zip(again[2:], (dq, dk, dv))), f"{name}: not reproducible"
    if not p:
        assert s_dmask.shape == (0,)
    check_varlen(name, lens_q, lens_k, (q, k, v, dout), (out, lse, dq, dk, dv, s_dmask), causal, window, softcap,
                 slopes, p, seed, scale)


def case_configs(case):
    """The (forward, backward) configs selection runs for ``case`` (with the ranks patched as
    sm90_ranked does), for the precompile below."""
    from cuflash import _gpu, select, varlen

    name, feats, dtype, d, causal, heads = case[:6]
    h, hkv = HEADS[heads]
    window = ((37, -1) if causal else (50, 20)) if "window" in feats else (-1, -1)
    args = (dtype, len(LENS[0]), max(LENS[0]), max(LENS[1]), h, hkv, d, causal, window,
            10.0 if "softcap" in feats else 0.0, causal if "alibi" in feats else None,
            P_DROP if "dropout" in feats else 0.0, case[6] if len(case) > 6 else False)
    return [select.choose(varlen.features_problem(op, *args), _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]
            for op in ("fwd", "bwd")]


if __name__ == "__main__":
    # python tests/test_sm90_varlen_mix_gpu.py --precompile [id substrings]: compile the kernels of the
    # matching cases in parallel processes (CuPy's disk cache), before pytest runs them
    import os
    import sys
    import time

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cuflash.compile import precompile
    from cuflash.families import sm90_bwd

    assert sys.argv[1:2] == ["--precompile"], "usage: --precompile [case id substrings]"
    sm90_bwd.VARLEN_SMALL_D_FEATURES, sm90_bwd.VARLEN_D128_FEATURES = {64: ALL_SETS, 96: ALL_SETS}, ALL_SETS
    keys = sys.argv[2:]
    t0 = time.time()
    cfgs = {c.kernel_name(): c for case in CASES if not keys or any(k in case[0] for k in keys)
            for c in case_configs(case)}
    failed = [(c.name, e[-800:]) for c, _, e in precompile(list(cfgs.values())) if e]
    print(f"precompiled {len(cfgs)} kernels in {time.time() - t0:.0f} s; failed: {failed}")
