"""sm90_fwd's softcap forward and the default backward at tiny shapes over many seeds, on an H100:
the forward's LSE must come from the scores the backward recomputes.

fold_cap 4 (Q prescaled by softcap_in in bf16 in shared memory) computed the forward's scores, hence
its LSE, from a rounded Q·softcap_in, while every backward recomputes P from the unscaled Q: at
1 query x 1 key P = exp(s_bwd - LSE) != 1, and dV = P dO missed the bound (session 19:
test_softcap_fixed_max_gpu::test_small_keys_fwd_bwd[bf16-cap5-causal], dv error 0.0312 against
0.0288, one seed in a few). This test draws fresh inputs for SEEDS seeds at each of SHAPES, bf16
caps 5 and 30 (the fixed max) and causal / not, with the heuristic's fold_cap (3 since session 19)
and fold_cap 3 forced; errors within 2x (forward) / 3x (gradients) plain bf16 attention's against
float64 (test_features_gpu.check_close), outputs NaN-poisoned.
"""
import os

import pytest

import cuflash

from test_features_gpu import check_close, feature_attention, grads  # noqa: E402
from test_softcap_fixed_max_gpu import fwd_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

SEEDS = int(os.environ.get("CUFLASH_SOFTCAP_SEEDS", "24"))
# (seqlen_q, seqlen_k): one key (P = 1 exactly in the reference), two, a few, s_q != s_k
SHAPES = [(1, 1), (2, 1), (1, 2), (3, 3), (5, 2), (2, 7)]
# fold_cap forced, None: the heuristic's. CUFLASH_SOFTCAP_FOLDS="3,4" adds others (4 is refused by
# the config since session 19: sm90_fwd.FOLD4_TIMING turns it back on, for timing and this check;
# 0: the unfolded softcap step, for comparison)
FOLDS = [None] + [int(f) for f in filter(None, os.environ.get("CUFLASH_SOFTCAP_FOLDS", "3").split(","))]


@pytest.mark.parametrize("fold", FOLDS, ids=[f"fold{f}" if f else "heuristic" for f in FOLDS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cap", [5.0, 30.0], ids=["cap5", "cap30"])
def test_tiny_shapes_many_seeds(cap, causal, fold, monkeypatch):
    import torch

    from cuflash.families import sm90_fwd

    if fold == 4:   # (refused by the config: this shows what the test catches)
        monkeypatch.setattr(sm90_fwd, "FOLD4_TIMING", True)

    scale = 128 ** -0.5
    fails = []
    for seed in range(SEEDS):
        for sq, sk in SHAPES:
            torch.manual_seed(seed)
            q, k, v, dout = (torch.randn(1, s, 2, 128, device="cuda", dtype=torch.bfloat16)
                             for s in (sq, sk, sk, sq))
            cfg = fwd_config("bf16", q, k, causal, cap, True, fold) if fold != 0 else \
                fwd_config("bf16", q, k, causal, cap, True).replace(fold_cap=0)   # (0: the unfolded step)
            what = f"{cfg.name} seed {seed} {sq}x{sk}"
            call = lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, config=cfg)  # noqa: E731
            ref = lambda q, k, v: feature_attention(q, k, v, scale, causal, (-1, -1), cap, None, torch.float64)[0]  # noqa: E731
            low = lambda q, k, v: feature_attention(q, k, v, scale, causal, (-1, -1), cap, None, q.dtype)[0]  # noqa: E731
            try:
                check_close(call(q, k, v), ref(q, k, v), low(q, k, v), 2, f"{what} out")
                ours, want, base = grads(call, q, k, v, dout), grads(ref, q, k, v, dout.double()), \
                    grads(low, q, k, v, dout)
                for name, a, r, b in zip(("dq", "dk", "dv"), ours, want, base):
                    check_close(a, r, b, 3, f"{what} {name}")
            except AssertionError as e:
                fails.append(str(e))
    assert not fails, f"{len(fails)} of {SEEDS * len(SHAPES)} failed:\n" + "\n".join(
        f.split("\n")[0].replace("sm90fwd_bf16_d128_", "") for f in fails[:12])
