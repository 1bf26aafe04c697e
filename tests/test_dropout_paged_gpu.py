"""Dropout with a paged K/V cache on the GPU (flash_attn_varlen_func's block_table): the keys and
values gathered from their pages, then the varlen dropout call: out, LSE, S_dmask and gradients
(through the gather into the paged k, v) equal the packed call's on the gathered keys, bit for bit
(deterministic backward); odd lengths (0, 1, 17, 113), GQA, causal. 2 compiles (the varlen dropout
forward and backward, d64 bf16)."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.usefixtures("poison_outputs")
def test_paged_dropout_is_the_gathered_varlen_call():
    import torch

    import cuflash
    from cuflash import varlen

    lens_q, lens_k, page, h, h_kv, d = [1, 17, 0, 113], [33, 1, 5, 113], 16, 4, 2, 64
    pages_of = [-(-n // page) for n in lens_k]
    num_pages = sum(pages_of) + 3
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))
    table = torch.full((len(lens_k), max(pages_of)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = perm[used:used + n]
        used += n
    gen = torch.Generator(device="cuda").manual_seed(2)
    kc = torch.randn(num_pages, page, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    vc = torch.randn(num_pages, page, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device="cuda")
    seed, table = (99, 5), table.cuda()
    kw = dict(causal=True, dropout_seed=seed, return_attn_probs=True, deterministic=True)
    out, lse, probs = cuflash.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 113, 113, 0.17, block_table=table, **kw)
    kp, vp = (varlen.gather_paged(x, table.cpu(), lens_k, xp="torch") for x in (kc, vc))
    want, want_lse, want_probs = cuflash.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 113, 113, 0.17, **kw)
    assert not out.isnan().any() and torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(probs, want_probs)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, kc, vc), dout)
    gw = torch.autograd.grad(want, (q, kc, vc), dout)
    for what, a, b in zip(("dq", "dk_cache", "dv_cache"), g, gw):
        assert not a.isnan().any() and torch.equal(a, b), what
