"""flash_attn_varlen_func with block_table (a paged K/V cache; fa2_fwd_paged) on the GPU.

Each call runs on a cache whose pages are shuffled (block tables are random permutations, their
unused columns -1), and is compared with (a) the float64 reference of the keys gathered from
their pages, per sequence, under the 2x rule of tests/test_varlen_features_gpu.py, outputs
poisoned (NaN) before the launch, and (b) the packed call without block_table on the gathered
keys (fa2_fwd: the same tiles and arithmetic), to a few ulps. Page sizes 16, 256 and 7 (tiles
straddle pages); lengths 0 and 1, s_q != s_k, GQA / MQA, bf16 / fp16, head dims 64, 128 and 72.
Compile count: 4 paged kernels (and their packed twins).
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import varlen

from conftest import torch_dtype  # noqa: E402
from test_varlen_features_gpu import HEADS, check_outputs, feature_attention, per_sequence, slopes_of  # noqa: E402
from test_varlen_gpu import LENS, cu_seqlens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (id, dtype, head dim, causal, window, softcap, alibi, heads, page_block_size)
CASES = [
    ("causal_bf16_d128_gqa_page256", "bf16", 128, True, (-1, -1), 0.0, None, "gqa", 256),
    ("full_fp16_d64_mqa_page16", "fp16", 64, False, (-1, -1), 0.0, None, "mqa", 16),
    ("window_alibi_softcap_bf16_d72_gqa_page7", "bf16", 72, True, (40, -1), 20.0, "bh", "gqa", 7),
    ("window_lr_alibi_h_fp16_d64_mha_page16", "fp16", 64, False, (33, 9), 0.0, "h", "mha", 16),
]


def paged_cache(lens_k, hkv, d, dtype, page, seed=0):
    """(k_cache, v_cache, block_table, k_packed, v_packed): the pages of every sequence shuffled
    over a cache with a few spare pages; unused table columns -1."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // page) for n in lens_k]
    num_pages = sum(need) + 3
    k = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=dtype, generator=g)
    perm = np.random.default_rng(seed).permutation(num_pages)
    cols = max(need) + 2
    table = np.full((len(lens_k), cols), -1, np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    table_t = torch.as_tensor(table, device="cuda")
    kp = varlen.gather_paged(k.cpu(), table, lens_k, xp="torch").cuda()
    vp = varlen.gather_paged(v.cpu(), table, lens_k, xp="torch").cuda()
    return k, v, table_t, kp, vp


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("lens", [LENS, ([1023, 1, 0, 300], [2049, 5, 9, 0])], ids=["short", "long"])
def test_paged_forward(case, lens):
    import torch

    name, dtype, d, causal, window, softcap, alibi, heads, page = case
    lens_q, lens_k = lens
    h, hkv = HEADS[heads]
    tdtype = torch_dtype(dtype)
    kc, vc, table, kp, vp = paged_cache(lens_k, hkv, d, tdtype, page)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=tdtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    slopes = slopes_of(alibi, len(lens_q), h)
    scale = 1 / math.sqrt(d)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    out, lse, _ = cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 return_attn_probs=True, block_table=table, **kw)
    assert out.shape == q.shape and lse.shape == (h, sum(lens_q))

    def attend(b, qs, ks, vs, dt):
        sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1])
        return feature_attention(qs, ks, vs, scale, causal, window, softcap,
                                 None if sl is None else sl.to(torch.float64 if dt == torch.float64
                                                               else torch.float32), dt)

    dout = torch.zeros_like(q)
    ref = per_sequence(lens_q, lens_k, q.double(), kp.double(), vp.double(), dout.double(),
                       torch.float64, attend)
    low = per_sequence(lens_q, lens_k, q, kp, vp, dout, tdtype, attend)
    check_outputs(out, lse, ref, low, f"{name}: ")
    # the packed call on the gathered keys: same tiles and arithmetic
    want, want_lse, _ = cuflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       return_attn_probs=True, **kw)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


def test_paged_backward_raises_and_cupy_agrees():
    import cupy
    import torch

    name, dtype, d, causal, window, softcap, alibi, heads, page = CASES[1]
    lens_q, lens_k = LENS
    h, hkv = HEADS[heads]
    kc, vc, table, _, _ = paged_cache(lens_k, hkv, d, torch_dtype(dtype), page)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch_dtype(dtype), requires_grad=True)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out = cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table)
    with pytest.raises(NotImplementedError, match="^block_table"):
        out.float().sum().backward()
    cout = cuflash.flash_attn_varlen_func(*(cupy.asarray(x.detach()) for x in (q, kc, vc, cu_q, cu_k)),
                                          max(lens_q), max(lens_k), block_table=cupy.asarray(table))
    assert np.array_equal(cupy.asnumpy(cout).view(np.uint16), out.detach().cpu().numpy().view(np.uint16))


def test_paged_bad_block_table_is_refused_before_any_launch():
    import torch

    lens_q, lens_k = LENS
    kc, vc, table, _, _ = paged_cache(lens_k, 2, 64, torch.bfloat16, 16)
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    bad = table.clone()
    bad[0, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="^block_table: sequence 0 uses page ids"):
        cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), block_table=bad)
