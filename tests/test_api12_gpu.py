"""The last of flash-attn 2.8's API on the GPU: block_table under torch.compile (op
cuflash::varlen_fwd_paged), flash_attn_with_kvcache on NumPy arrays (copied to the GPU, the
append copied back into the caller's cache).

Each is checked against the eager torch call on the same data, bitwise (the same kernels and
plans run; the eager paths are tested against the float64 reference in
tests/test_varlen_paged_gpu.py and tests/test_decode_gpu.py), outputs poisoned (NaN) before
every launch. Compile count: 1 paged forward (reused by both tests of it), 2 decode kernels.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash.decode import flash_attn_with_kvcache

from test_decode_gpu import make_case  # noqa: E402
from test_varlen_gpu import cu_seqlens  # noqa: E402
from test_varlen_paged_gpu import paged_cache  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

LENS_Q, LENS_K = [17, 1, 0, 113], [1023, 5, 9, 0]


def _paged_call():
    import torch

    kc, vc, table, _, _ = paged_cache(LENS_K, 2, 128, torch.bfloat16, 16, seed=1)
    q = torch.randn(sum(LENS_Q), 8, 128, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)

    def f(q, kc, vc):
        return cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                              softmax_scale=1 / math.sqrt(128), causal=True,
                                              window_size=(256, -1), block_table=table,
                                              return_attn_probs=True)
    return f, q, kc, vc


def test_paged_torch_compile_matches_eager():
    import torch

    torch._dynamo.reset()
    f, q, kc, vc = _paged_call()
    out, lse, _ = f(q, kc, vc)
    out_c, lse_c, probs = torch.compile(f, fullgraph=True)(q, kc, vc)
    torch.cuda.synchronize()
    assert probs.shape == (0,) and probs.dtype == q.dtype and probs.device == q.device  # as flash-attn
    assert torch.equal(out_c, out) and torch.equal(lse_c, lse)
    assert not out.isnan().any()


def test_paged_torch_compile_backward_refuses():
    import torch

    torch._dynamo.reset()
    f, q, kc, vc = _paged_call()
    want, _, _ = f(q, kc, vc)
    q.requires_grad_()
    out = torch.compile(lambda q: f(q, kc, vc)[0], fullgraph=True)(q)
    assert torch.equal(out.detach(), want)
    with pytest.raises(NotImplementedError, match="^block_table: the backward"):
        out.float().sum().backward()


def _as_numpy(x, dtype):
    """A torch CUDA tensor's bits as a NumPy array of ``dtype`` (fp16, or ml_dtypes' bf16)."""
    import torch

    return x.detach().cpu().view(torch.int16).numpy().view(dtype)


@pytest.mark.parametrize("dtype,page", [("fp16", None), ("fp16", 48), ("bf16", 16)])
def test_kvcache_numpy_matches_torch(dtype, page):
    """NumPy inputs run the same kernels as the torch call: out, LSE and the appended caches
    (copied back into the caller's arrays, in place) bitwise equal; append + rotary, GQA."""
    import torch

    if dtype == "bf16":
        np_dtype = pytest.importorskip("ml_dtypes").bfloat16
    else:
        np_dtype = np.float16
    rng = np.random.default_rng(11)
    base = make_case(rng, 3, 2, [0, 17, 300], 8, 2, 128, dtype, page=page, seqlen_new=2,
                     rotary_dim=64)
    kw = dict(causal=True, num_splits=0, return_softmax_lse=True)
    ours = {k: v.clone() for k, v in base.items()}
    out_t, lse_t = flash_attn_with_kvcache(**ours, **kw)
    theirs = {k: (_as_numpy(v, np_dtype) if v.dtype in (torch.float16, torch.bfloat16)
                  else v.cpu().numpy()) if isinstance(v, torch.Tensor) else v
              for k, v in base.items()}
    kc, vc = theirs["k_cache"], theirs["v_cache"]
    out_n, lse_n = flash_attn_with_kvcache(**theirs, **kw)
    assert type(out_n) is np.ndarray and out_n.dtype == np_dtype and out_n.shape == out_t.shape
    assert np.array_equal(out_n.view(np.int16), _as_numpy(out_t, np.int16))
    assert np.array_equal(lse_n, lse_t.cpu().numpy(), equal_nan=True)
    assert theirs["k_cache"] is kc and theirs["v_cache"] is vc
    for name, arr in (("k_cache", kc), ("v_cache", vc)):
        assert np.array_equal(arr.view(np.int16), _as_numpy(ours[name], np.int16)), \
            f"{name}: the NumPy cache differs from the torch call's"
