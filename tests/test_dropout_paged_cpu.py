"""Dropout with a paged K/V cache (flash_attn_varlen_func's block_table) and the varlen torch CPU
path's dropout_seed, without a GPU: the CPU varlen call with dropout_seed drops the kernels' mask of
that seed (sequence i's: cuflash.dropout.keep_mask at batch index i), so a paged call (the gathered
keys' varlen call) and a packed one agree, mask for mask."""
import numpy as np
import pytest

import cuflash
from cuflash import dropout

torch = pytest.importorskip("torch")


def test_varlen_cpu_dropout_seed_is_the_kernels_mask():
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k, h = [3, 0, 17, 1], [5, 4, 33, 0], 2
    q = torch.randn(sum(lens_q), h, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens_k), h, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    seed = (0x1234_5678_9ABC, 77)
    out, _, mask = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 33, 0.25, return_attn_probs=True,
                                                  dropout_seed=seed)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq and lk:
            want = dropout.keep_mask(*seed, 0.25, 1, h, lq, lk, first_batch=i)[0]
            assert np.array_equal(mask[i, :, :lq, :lk].numpy(), want), i
        assert not mask[i, :, lq:].any() and not mask[i, :, :, lk:].any()
    again = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 33, 0.25, dropout_seed=seed)
    assert torch.equal(out, again)
