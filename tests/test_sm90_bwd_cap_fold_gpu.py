"""sm90_bwd's folded softcap step (cap_fold, kCapFold 1 / 2), forced with bwd_config=, on an H100.

cap_fold keeps Pᵀ ∘ (1 - tanh²) in the thread's words instead of 1 - tanh², folds softcap_out into the
exponent's FFMA and masks t (kCapHiddenT) before the exp2; form 2 also multiplies dPᵀ - D_i by the word
in 16 bits (dSᵀ rounded twice; bf16 only), form 3 also takes a quarter of the exp2s on the FMA pipes. Gradients within 3x plain attention's error in the same precision
against float64 (test_features_gpu.check_close), fresh inputs, outputs poisoned: bf16 and fp16, caps 5,
30 and 50 (Gemma 2's), causal and not, odd lengths with s_q != s_k both ways (ragged and masked blocks,
queries with no key under causal), MHA / GQA / MQA, head dims 64, 128 and 256. The forward is the
default one for the call.
"""
import pytest

import cuflash

from test_features_gpu import check_close, feature_attention, grads, inputs  # noqa: E402
from test_sm90_bwd_features_gpu import FAM  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (seqlen_q, seqlen_k, heads)
SHAPES = [(1, 17, "gqa"), (17, 1, "mha"), (113, 1023, "mqa"), (1023, 113, "gqa"), (2049, 1023, "mha")]


def fold_config(form, dtype, d, causal, arch=None):
    """sm90_bwd's config for a softcap call of the class (the heuristic through for_problem: a
    bwd_config= is validated before selection applies the call's features) with cap_fold = form."""
    p = cuflash.Problem("bwd", dtype, 2, 1023, 1023, 4, 2, d, causal, features=("softcap",), softcap=30.0)
    if arch is None:
        import torch

        arch = torch.cuda.get_device_capability()
        why = FAM.supports(arch, p)
        if why:
            pytest.skip(why)
    cfg = FAM.for_problem(FAM.heuristic(p, arch), p).replace(cap_fold=form)
    if cfg.problems():   # (the d128 dynamic kernel: with wide_epi, as the heuristic takes it)
        cfg = cfg.replace(wide_epi=True)
    assert not cfg.problems(), cfg.problems()
    return cfg


def check_fold(form, dtype, d, causal, cap, shapes=SHAPES):
    import torch

    cfg = fold_config(form, dtype, d, causal)
    for sq, sk, heads in shapes:
        q, k, v, dout = inputs(2, sq, sk, heads, d, dtype)
        call = lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, bwd_config=cfg)  # noqa: E731
        ours = grads(call, q, k, v, dout)
        scale = d ** -0.5
        ref = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, (-1, -1), cap, None,
                                                      torch.float64)[0], q, k, v, dout.double())
        low = grads(lambda q, k, v: feature_attention(q, k, v, scale, causal, (-1, -1), cap, None,
                                                      q.dtype)[0], q, k, v, dout)
        what = f"{cfg.name} softcap={cap} {sq}x{sk} {heads}"
        for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
            check_close(a, r, b, 3, f"{what} {name}")


@pytest.mark.parametrize("cap", [5.0, 30.0, 50.0], ids=["cap5", "cap30", "cap50"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form,dtype", [(1, "bf16"), (2, "bf16"), (3, "bf16"), (1, "fp16")])   # (2, 3: bf16 only)
def test_cap_fold_d128(form, dtype, causal, cap):
    check_fold(form, dtype, 128, causal, cap)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", [1, 2, 3])
def test_cap_fold_other_head_dims(form, causal, d):
    check_fold(form, "bf16", d, causal, 30.0, SHAPES[::2])
