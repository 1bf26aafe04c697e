"""The CuPy backward's repeat-call path (api._bwd_plans): a second call with arrays of the same
layout skips validation and selection, and gives the validated call's gradients bit for bit; a
call that differs in anything the plan depends on (causal, scale, deterministic, a window, a
config, a non-contiguous LSE) takes the validated path and gets its own plan."""
import numpy as np
import pytest

import cuflash
from cuflash import api

pytestmark = [pytest.mark.gpu]


def _arrays(shape_q, shape_k, dtype, seed):
    import cupy

    rng = np.random.default_rng(seed)
    q = cupy.asarray(rng.standard_normal(shape_q).astype(dtype))
    k, v = (cupy.asarray(rng.standard_normal(shape_k).astype(dtype)) for _ in range(2))
    dout = cupy.asarray(rng.standard_normal(shape_q).astype(dtype))
    return q, k, v, dout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", [((2, 129, 4, 64), (2, 77, 2, 64)), ((1, 300, 8, 128), (1, 300, 8, 128))])
def test_repeat_call_same_gradients(count_validation, causal, shapes):
    """Bit for bit with deterministic=True (the dQ sums in a fixed order); without it the dQ sums'
    order varies from call to call, so dq is compared to a tolerance there."""
    q, k, v, dout = _arrays(*shapes, np.float16, 0)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    first = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    n_bwd = count_validation.count("bwd")
    assert len(api._bwd_plans) == 1
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert bool((a == b).all())
    assert count_validation.count("bwd") == n_bwd, "a repeat call was validated again"
    # new arrays of the same layout: the cached plan, their own values (against a validated call)
    q2, k2, v2, dout2 = _arrays(*shapes, np.float16, 1)
    out2, lse2, _ = cuflash.flash_attn_func(q2, k2, v2, causal=causal, return_attn_probs=True)
    fast = cuflash.flash_attn_backward(dout2, q2, k2, v2, out2, lse2, causal=causal, deterministic=True)
    api._bwd_plans.clear()
    slow = cuflash.flash_attn_backward(dout2, q2, k2, v2, out2, lse2, causal=causal, deterministic=True)
    for a, b in zip(fast, slow):
        assert bool((a == b).all())
    # the unordered backward: its own plan, one validation for any number of calls
    n_bwd = count_validation.count("bwd")
    grads = [cuflash.flash_attn_backward(dout2, q2, k2, v2, out2, lse2, causal=causal) for _ in range(3)]
    assert count_validation.count("bwd") == n_bwd + 1
    for g in grads[1:]:
        for a, b, ref in zip(g, grads[0], slow):
            scale = float(abs(ref.astype(np.float32)).max()) + 1e-6
            assert float(abs(a.astype(np.float32) - b.astype(np.float32)).max()) <= 1e-2 * scale


def test_differing_calls_get_their_own_plan(count_validation):
    import cupy

    q, k, v, dout = _arrays((1, 200, 4, 64), (1, 200, 4, 64), np.float16, 2)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=False, return_attn_probs=True)
    base = cuflash.flash_attn_backward(dout, q, k, v, out, lse)
    outc, lsec, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    causal = cuflash.flash_attn_backward(dout, q, k, v, outc, lsec, causal=True)
    assert not bool((base[0] == causal[0]).all())
    assert len(api._bwd_plans) == 2
    # a window that means plain causal (left unbounded, right 0) and a scale: validated each time
    n = count_validation.count("bwd")
    cuflash.flash_attn_backward(dout, q, k, v, outc, lsec, window_size=(-1, 0))
    cuflash.flash_attn_backward(dout, q, k, v, outc, lsec, window_size=(-1, 0))
    assert count_validation.count("bwd") == n + 2
    cuflash.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.1)
    assert len(api._bwd_plans) == 3
    # deterministic: its own plan; bitwise equal twice
    d1 = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True)
    assert len(api._bwd_plans) == 4
    d2 = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True)
    for a, b in zip(d1, d2):
        assert bool((a == b).all())
    # a non-contiguous LSE is made contiguous by the validated path and never cached
    wide = cupy.empty(lse.shape[:-1] + (2 * lse.shape[-1],), lse.dtype)
    wide[..., ::2] = lse
    before = len(api._bwd_plans)
    strided = cuflash.flash_attn_backward(dout, q, k, v, out, wide[..., ::2], deterministic=True)
    assert len(api._bwd_plans) == before
    for a, b in zip(d1, strided):
        assert bool((a == b).all())
