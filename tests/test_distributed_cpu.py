"""cuflash.distributed without GPUs: ring attention over gloo, P = 2, 3, 4 processes, CPU
tensors (cuflash's float64 reference path), against single-process attention.

One spawn per P; each process runs every case and checks its own shard of the output and of
the gradients (q, k, v) against the unsharded reference; a failure raises in the worker and
fails mp.spawn. Plus pure functions (shard round trip, pair classification, the merge).
"""
from __future__ import annotations

import math
import socket
import types

import numpy as np
import pytest
import torch

from cuflash import distributed as cfd
from cuflash import reference

# (batch, seqlen per chunk, nheads, nheads_kv, headdim, causal, layout, dtype)
CASES = [
    (1, 3, 2, 2, 8, False, "zigzag", torch.float64),
    (2, 4, 2, 2, 16, True, "zigzag", torch.float64),
    (1, 5, 4, 2, 8, True, "zigzag", torch.float64),      # GQA
    (1, 3, 3, 1, 8, True, "contiguous", torch.float64),  # MQA, contiguous layout
    (1, 4, 2, 1, 8, False, "contiguous", torch.float32),
    (1, 2, 2, 2, 8, True, "zigzag", torch.float32),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_inputs(case, world, seed):
    b, n, h, hk, d, causal, layout, dtype = case
    chunks = 2 * world if layout == "zigzag" else world
    s = n * chunks
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _shard(x, rank, world, layout, dim=1):
    if layout == "zigzag":
        return cfd.zigzag_shard(x, rank, world, dim)
    return cfd.contiguous_shard(x, rank, world, dim)


def _worker(rank, world, port, cases):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for i, case in enumerate(cases):
            _check_case(rank, world, case, seed=1000 + i)
        for i, case in enumerate(VARLEN_CASES):  # the same processes: no second spawn
            _check_varlen_case(rank, world, case, seed=2000 + i)
        _check_case(rank, world, cases[1], seed=3000, strided=True)
        try:  # the backward's other transfer schedule: K/V and accumulators in one batch;
            # multi-chunk calls split per q chunk; the backward the other way round
            flip = lambda: (not cfd.EARLY_SEND, not cfd.SPLIT_Q, not cfd.REVERSE_BWD)  # noqa: E731
            cfd.EARLY_SEND, cfd.SPLIT_Q, cfd.REVERSE_BWD = flip()
            _check_case(rank, world, cases[1], seed=4000)
            _check_case(rank, world, cases[3], seed=4001)
            _check_case(rank, world, cases[0], seed=4002)
            _check_case(rank, world, cases[2], seed=4003, strided=True)
        finally:
            cfd.EARLY_SEND, cfd.SPLIT_Q, cfd.REVERSE_BWD = flip()
        saved = cfd.DKV_HOME, cfd.REVERSE_BWD, cfd.BWD_LOW_MEMORY
        try:  # dK/dV shares sent home during the next step (DKV_HOME, BWD_LOW_MEMORY off): dense
            # (contiguous causal: steps that make no share at all), varlen, and with the
            # backward the other way round
            cfd.DKV_HOME, cfd.BWD_LOW_MEMORY = True, False
            _check_case(rank, world, cases[1], seed=5000)
            _check_case(rank, world, cases[3], seed=5001)
            _check_case(rank, world, cases[2], seed=5002, strided=True)
            _check_varlen_case(rank, world, VARLEN_CASES[0], seed=5003)
            _check_varlen_case(rank, world, VARLEN_CASES[1], seed=5004)
            cfd.REVERSE_BWD = not saved[1]
            _check_case(rank, world, cases[1], seed=5005)
            _check_case(rank, world, cases[4], seed=5006)
            # the other path: an fp32 accumulator travelling with the block (both off)
            cfd.BWD_LOW_MEMORY, cfd.DKV_HOME = False, False
            _check_case(rank, world, cases[2], seed=5007)
            cfd.REVERSE_BWD = saved[1]
            _check_case(rank, world, cases[1], seed=5008)
            _check_case(rank, world, cases[3], seed=5009)
            _check_varlen_case(rank, world, VARLEN_CASES[4], seed=5010)
        finally:
            cfd.DKV_HOME, cfd.REVERSE_BWD, cfd.BWD_LOW_MEMORY = saved
        saved = cfd.DQ_IN_WORKSPACE
        try:  # dQ summed in an accumulator of the ring's own (rounded shares added)
            cfd.DQ_IN_WORKSPACE = False
            _check_case(rank, world, cases[1], seed=6000)
            _check_case(rank, world, cases[4], seed=6001)
        finally:
            cfd.DQ_IN_WORKSPACE = saved
        for i, case in enumerate((cases[0], cases[1], cases[2])):
            _check_lazy_home_bits(rank, world, case, seed=7000 + i)
        saved = cfd.BWD_HEAD_GROUPS
        try:  # the backward on all heads at once (BWD_HEAD_GROUPS 1; the cases above ran it per
            # group of heads where nheads_kv allows): the same bits per head as per group; then
            # more groups than heads (GQA 4 / 2 heads: 2 groups)
            for i, case in enumerate((cases[0], cases[2])):
                _check_head_group_bits(rank, world, case, seed=8000 + i)
            cfd.BWD_HEAD_GROUPS = 1
            _check_case(rank, world, cases[1], seed=8002)
            _check_case(rank, world, cases[2], seed=8003, strided=True)
            cfd.BWD_HEAD_GROUPS = 16
            _check_case(rank, world, cases[2], seed=8004)
            _check_case(rank, world, cases[1], seed=8005, strided=True)
        finally:
            cfd.BWD_HEAD_GROUPS = saved
        saved = cfd.FWD_HEAD_GROUPS, cfd.REVERSE_BWD
        try:  # the forward's ring on all heads at once (FWD_HEAD_GROUPS 1; the cases above ran it
            # per group of heads), and per group with the backward the other way round (the
            # forward keeps its last block, per group)
            cfd.FWD_HEAD_GROUPS = 1
            _check_case(rank, world, cases[0], seed=8099)
            cfd.FWD_HEAD_GROUPS = 4
            _check_case(rank, world, cases[0], seed=8100)
            _check_case(rank, world, cases[2], seed=8101, strided=True)
            cfd.REVERSE_BWD = True
            _check_case(rank, world, cases[1], seed=8102)
            _check_case(rank, world, cases[3], seed=8103)
        finally:
            cfd.FWD_HEAD_GROUPS, cfd.REVERSE_BWD = saved
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_case(rank, world, case, seed, strided=False):
    b, n, h, hk, d, causal, layout, dtype = case
    q, k, v, dout = _full_inputs(case, world, seed)
    # the unsharded reference: float64 NumPy
    ref_out, ref_lse = reference.attention_naive(q.numpy(), k.numpy(), v.numpy(), causal=causal,
                                                 return_lse=True)
    ref_grads = reference.attention_backward_naive(dout.numpy(), q.numpy(), k.numpy(),
                                                   v.numpy(), causal=causal)
    local = [_shard(x, rank, world, layout).to(dtype) for x in (q, k, v)]
    ql, kl, vl = (x.clone().requires_grad_() for x in local)
    if strided:  # k, v as views of one packed kv tensor (not contiguous): the ring copies them
        kv = torch.stack(local[1:], dim=2).requires_grad_()
        k_in, v_in = kv.unbind(2)
        assert not k_in.is_contiguous()
    else:
        k_in, v_in = kl, vl
    out, lse, _ = cfd.ring_flash_attn_func(ql, k_in, v_in, causal=causal, layout=layout,
                                           return_attn_probs=True)
    out.backward(_shard(dout, rank, world, layout).to(dtype))
    if strided:
        kl, vl = (types.SimpleNamespace(grad=g) for g in kv.grad.unbind(2))
    # cuflash returns lse in fp32 (also from its float64 CPU path): the merge weights carry
    # fp32 rounding, hence 1e-6 for float64 inputs
    tol = 2e-6 if dtype == torch.float64 else 2e-5
    expect = {"out": ref_out, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}
    got = {"out": out, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    for name, want in expect.items():
        want = _shard(torch.from_numpy(want), rank, world, layout)
        err = (got[name].double() - want).abs().max().item()
        assert got[name].dtype == dtype, (name, got[name].dtype)
        assert err <= tol * max(1.0, want.abs().max().item()), \
            f"rank {rank}/{world} case {case}: {name} max error {err:.3e}"
    want_lse = _shard(torch.from_numpy(ref_lse), rank, world, layout, dim=2)
    assert lse.dtype == torch.float32
    assert (lse.double() - want_lse).abs().max().item() <= 1e-5 * (1 + want_lse.abs().max().item())


def _check_same_bits(rank, world, case, seed, flag, values):
    """The cuflash.distributed setting ``flag`` at each of ``values`` gives the same bits (bf16
    inputs)."""
    q, k, v, dout = _full_inputs(case, world, seed)
    layout = case[6]
    grads = []
    saved = getattr(cfd, flag)
    try:
        for value in values:
            setattr(cfd, flag, value)
            leaves = [_shard(x, rank, world, layout).to(torch.bfloat16).requires_grad_()
                      for x in (q, k, v)]
            out = cfd.ring_flash_attn_func(*leaves, causal=case[5], layout=layout)
            out.backward(_shard(dout, rank, world, layout).to(torch.bfloat16))
            grads.append([x.grad for x in leaves])
    finally:
        setattr(cfd, flag, saved)
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), \
            f"rank {rank}/{world} case {case}: {name} differs with {flag} {values}"


def _check_lazy_home_bits(rank, world, case, seed):
    """HOME_LAZY_FP32 on and off give the same bits (bf16 inputs: the home accumulator kept in k's
    dtype until a second share, the last of two added there, rounds as the fp32 sum does)."""
    _check_same_bits(rank, world, case, seed, "HOME_LAZY_FP32", (True, False))


def _check_head_group_bits(rank, world, case, seed):
    """BWD_HEAD_GROUPS 1 and 2 give the same bits (each head's sums are the same additions)."""
    _check_same_bits(rank, world, case, seed, "BWD_HEAD_GROUPS", (1, 2))


# varlen: (sequence lengths in chunks, nheads, nheads_kv, headdim, causal, layout, dtype);
# a sequence of u chunks is u * 2P (zigzag) or u * P (contiguous) tokens long
VARLEN_CASES = [
    ((0, 1, 3, 5), 2, 2, 8, True, "zigzag", torch.float64),
    ((2, 0, 1), 4, 2, 8, False, "zigzag", torch.float64),       # GQA, non-causal
    ((1, 3, 0, 5), 3, 1, 8, True, "contiguous", torch.float64),  # MQA, contiguous layout
    ((2, 1), 2, 1, 8, False, "contiguous", torch.float64),
    ((3, 2), 2, 2, 16, True, "zigzag", torch.float32),
    ((0, 0), 2, 2, 8, True, "zigzag", torch.float64),           # every sequence empty
]


def _check_varlen_case(rank, world, case, seed):
    import cuflash

    units, h, hk, d, causal, layout, dtype = case
    lens = [u * cfd.chunk_count(world, layout) for u in units]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    total, longest = int(cu[-1]), max(lens)
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(total, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    # the unsharded reference: single-process flash_attn_varlen_func on CPU float64 tensors
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse, _ = cuflash.flash_attn_varlen_func(*full, cu, cu, longest, longest,
                                                         causal=causal, return_attn_probs=True)
    ref_out.backward(dout)
    shard = lambda x, dim=0: cfd.varlen_shard(x, cu, rank, world, layout, dim)[0]  # noqa: E731
    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    if world > 1 and total:  # varlen_shard's local offsets are not the argument: refused first
        with pytest.raises(ValueError, match="^cu_seqlens: expected the GLOBAL"):
            cfd.ring_flash_attn_varlen_func(ql, kl, vl, cfd.varlen_shard(q, cu, rank, world,
                                                                         layout)[1], longest)
    out, lse, _ = cfd.ring_flash_attn_varlen_func(ql, kl, vl, cu, longest, causal=causal,
                                                  layout=layout, return_attn_probs=True)
    out.backward(shard(dout).to(dtype))
    tol = 2e-6 if dtype == torch.float64 else 2e-5
    expect = {"out": ref_out, "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
    got = {"out": out, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    for name, want in expect.items():
        want = shard(want.detach())
        assert got[name].dtype == dtype and got[name].shape == want.shape, (name, got[name].shape)
        err = (got[name].double() - want).abs().max().item() if want.numel() else 0.0
        assert err <= tol * max(1.0, want.abs().max().item() if want.numel() else 0.0), \
            f"rank {rank}/{world} varlen case {case}: {name} max error {err:.3e}"
    want_lse = shard(ref_lse, dim=1).double()
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape
    if want_lse.numel():
        assert (lse.double() - want_lse).abs().max().item() <= \
            1e-5 * (1 + want_lse.abs().max().item())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_process(world):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, _free_port(), CASES), nprocs=world, join=True)


# ---------------------------------------------------------------------------------------
# pure functions

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_round_trip(world):
    x = torch.arange(2 * 12 * world * 3).reshape(2, 12 * world, 3)
    shards = [cfd.zigzag_shard(x, r, world) for r in range(world)]
    assert all(s.shape == (2, 12, 3) for s in shards)
    assert torch.equal(cfd.zigzag_unshard(shards), x)
    n = 6  # rank r holds chunks r and 2P-1-r
    for r, s in enumerate(shards):
        assert torch.equal(s[:, :n], x[:, r * n:(r + 1) * n])
        assert torch.equal(s[:, n:], x[:, (2 * world - 1 - r) * n:(2 * world - r) * n])
    c = [cfd.contiguous_shard(x, r, world) for r in range(world)]
    assert torch.equal(cfd.contiguous_unshard(c), x)


def test_zigzag_errors_name_the_argument():
    x = torch.zeros(1, 6, 2)
    with pytest.raises(ValueError, match="x: the length"):
        cfd.zigzag_shard(x, 0, 2)
    with pytest.raises(ValueError, match="rank"):
        cfd.zigzag_shard(x, 3, 3)
    with pytest.raises(ValueError, match="world"):
        cfd.zigzag_shard(x, 0, 0)
    with pytest.raises(ValueError, match="shards\\[1\\]"):
        cfd.zigzag_unshard([torch.zeros(1, 4), torch.zeros(1, 6)])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_step_calls_cover_exactly_the_visible_pairs(world, layout, causal):
    """Over the P steps, each rank's calls cover every visible (q position, k position) pair
    exactly once, with the right mask (chunks of 3 positions)."""
    n = 3
    nchunks = 2 * world if layout == "zigzag" else world
    s = n * nchunks
    visible = np.tril(np.ones((s, s), bool)) if causal else np.ones((s, s), bool)
    covered = np.zeros((s, s), int)
    work = []
    for rank in range(world):
        qc = cfd.chunk_ids(rank, world, layout)
        pos_q = np.concatenate([np.arange(c * n, (c + 1) * n) for c in qc])
        done = 0
        for step in range(world):
            src = (rank - step) % world
            kc = cfd.chunk_ids(src, world, layout)
            pos_k = np.concatenate([np.arange(c * n, (c + 1) * n) for c in kc])
            for call in cfd.step_calls(qc, kc, causal):
                rows = pos_q[call.q0 * n:call.q1 * n]
                cols = pos_k[call.k0 * n:call.k1 * n]
                lq, lk = len(rows), len(cols)
                mask = np.tril(np.ones((lq, lk), bool), lk - lq) if call.causal \
                    else np.ones((lq, lk), bool)
                covered[np.ix_(rows, cols)] += mask
                done += mask.sum()
        work.append(done)
    assert np.array_equal(covered, visible.astype(int))
    if causal and layout == "zigzag":
        assert len(set(work)) == 1  # the zigzag layout balances the causal work


def test_head_groups():
    assert [cfd._head_groups(hk, 2) for hk in (1, 2, 3, 8)] == [1, 2, 1, 2]
    assert [cfd._head_groups(hk, 4) for hk in (6, 8, 5)] == [3, 4, 1]
    assert cfd._head_groups(8, 0) == 1 and cfd._head_groups(2, 16) == 2


def test_step_calls_zigzag_shapes():
    # P = 4, rank 1 holds chunks (1, 6)
    assert cfd.step_calls((1, 6), (1, 6), True) == [cfd.Call(0, 2, 0, 2, True)]
    assert cfd.step_calls((1, 6), (0, 7), True) == [cfd.Call(0, 2, 0, 1, False)]  # src < rank
    assert cfd.step_calls((1, 6), (2, 5), True) == [cfd.Call(1, 2, 0, 2, False)]  # src > rank
    assert cfd.step_calls((1, 6), (2, 5), False) == [cfd.Call(0, 2, 0, 2, False)]
    assert cfd.step_calls((0,), (1,), True) == []  # contiguous, a later block: skipped


def test_merge_partial_is_flash_decoding_combine():
    g = torch.Generator().manual_seed(0)
    b, s, h, d, splits = 2, 5, 3, 4, 3
    outs = torch.randn(splits, b, s, h, d, generator=g, dtype=torch.float64)
    lses = torch.randn(splits, b, h, s, generator=g, dtype=torch.float64)
    lses[1, 0, 0, 0] = -math.inf    # an empty split for one row
    lses[:, 1, 1, 1] = -math.inf    # a row with no key anywhere
    want_out, want_lse = reference.combine_splits(outs.numpy(), lses.numpy())
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    lse = torch.full((b, h, s), -math.inf, dtype=torch.float64)
    for i in range(splits):
        blse = lses[i].clone()
        blse[torch.isneginf(blse)] = math.inf  # cuflash's "no key" convention for a block
        cfd.merge_partial(out, lse, outs[i], blse)
    assert torch.isneginf(lse[1, 1, 1])
    lse[torch.isneginf(lse)] = math.inf
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)


def test_merge_partial_takes_low_precision_blocks_and_first_partial():
    """A bf16 block (the kernels' output) merges into the fp32 running result as its fp32
    value would; first_partial equals merging into an empty result (-inf lse, zeros)."""
    g = torch.Generator().manual_seed(1)
    b, s, h, d = 1, 6, 2, 8
    o1, o2 = (torch.randn(b, s, h, d, generator=g).bfloat16() for _ in range(2))
    l1, l2 = (torch.randn(b, h, s, generator=g) for _ in range(2))
    out, lse = cfd.first_partial(o1, l1.clone(), torch.float32)
    want_out = torch.zeros(b, s, h, d)
    want_lse = torch.full((b, h, s), -math.inf)
    cfd.merge_partial(want_out, want_lse, o1.float(), l1)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    cfd.merge_partial(out, lse, o2, l2)
    cfd.merge_partial(want_out, want_lse, o2.float(), l2)
    assert torch.allclose(out, want_out, rtol=0, atol=1e-6) and torch.equal(lse, want_lse)
    none = torch.full((b, h, s), math.inf)  # a block with no key for any row
    out2, lse2 = cfd.first_partial(torch.zeros(b, s, h, d), none, torch.float32)
    assert torch.isneginf(lse2).all() and not out2.any()


def test_reference_block_backward_is_attention_backward():
    """One block holding all keys: the global out/lse are the block's own, so the block
    backward is plain attention's backward (GQA, causal with s_q != s_k)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64)
    do = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64)
    for causal in (False, True):
        out, lse = reference.attention_naive(q.numpy(), k.numpy(), v.numpy(), causal=causal,
                                             return_lse=True)
        got = cfd.reference_block_backward(do, q, k, v, torch.from_numpy(out),
                                           torch.from_numpy(lse), 0.3535533905932738, causal)
        want = reference.attention_backward_naive(do.numpy(), q.numpy(), k.numpy(), v.numpy(),
                                                  causal=causal)
        for a, w in zip(got, want):
            np.testing.assert_allclose(a.numpy(), w, rtol=1e-10, atol=1e-10)


def test_ring_group_backend_must_move_the_tensors_device(monkeypatch):
    """CPU tensors with an NCCL group (or CUDA tensors with gloo) are refused naming group,
    before the first transfer would fail inside torch.distributed."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="^group: its backend 'nccl' does not move cpu"):
        cfd.ring_flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="^group: its backend 'nccl' does not move cpu"):
        cfd.ring_flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32), 8)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="^cu_seqlens: expected the GLOBAL"):  # past the group
        cfd.ring_flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 7], dtype=torch.int32), 7)


def test_ring_args_are_checked_before_any_transfer():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="layout"):
        cfd.ring_flash_attn_func(q, q, q, layout="striped")
    with pytest.raises(RuntimeError, match="group"):
        cfd.ring_flash_attn_func(q, q, q)
    with pytest.raises(TypeError, match="q"):
        cfd.ring_flash_attn_func(q.numpy(), q, q)


# ---------------------------------------------------------------------------------------
# bench --mode ring (the run itself needs GPUs)

def test_bench_ring_cli():
    from cuflash import bench

    a = bench.parser().parse_args(["--mode", "ring", "--ring-seqlens", "1024", "2048",
                                   "--ring-procs", "2", "--no-torch-cp"])
    assert bench.modes_of(a.mode) == ["ring"] and a.ring_seqlens == [1024, 2048]
    assert a.ring_procs == 2 and a.no_torch_cp and a.ring_budget_s == 270.0
    assert not a.ring_breakdown and a.ring_light_from == 524288 and a.ring_ab == []
    assert a.ring_ab_max is None and a.ring_rotate == 0 and a.ring_set is None
    a = bench.parser().parse_args(["--mode", "ring", "--ring-ab", "early_send", "nccl_priority",
                                   "fwd_dyn+nccl_ctas4", "rotate", "lib_priority",
                                   "--ring-ab-max", "524288", "--ring-rotate", "1",
                                   "--ring-set", "nccl_priority+fwd_dyn"])
    assert a.ring_ab == ["early_send", "nccl_priority", "fwd_dyn+nccl_ctas4", "rotate",
                         "lib_priority"]
    assert a.ring_ab_max == 524288 and a.ring_rotate == 1 and a.ring_set == "nccl_priority+fwd_dyn"
    from cuflash.bench import ring
    for name in a.ring_ab:
        assert all(p in ring.AB_VARIANTS or p.startswith("nccl_ctas") for p in name.split("+"))
    assert bench.parser().parse_args(["--mode", "ring", "--ring-set", "none"]).ring_set == ""
    for bad in ("nccl_ctas0", "fast", "fwd_dyn+", "fwd_dyn+fwd_dyn"):
        with pytest.raises(SystemExit):  # argparse: the type's ValueError, exit 2
            bench.parser().parse_args(["--mode", "ring", "--ring-ab", bad])
    a = bench.parser().parse_args(["--mode", "ring", "--ring-ab", "fwd_grid1", "--ring-ab-seqlens",
                                   "524288", "--ring-ab-causal", "no"])
    assert a.ring_ab == ["fwd_grid1"] and a.ring_ab_seqlens == [524288] and a.ring_ab_causal == "no"
    assert bench.parser().parse_args(["--mode", "ring"]).ring_ab_causal == "both"
    a = bench.parser().parse_args(["--mode", "ring", "--ring-breakdown", "--ring-light-from", "0"])
    assert a.ring_breakdown and a.ring_light_from == 0 and a.ring_seqlens is None
    assert "ring" not in bench.modes_of(["all"])


def test_bench_ring_parse_variant():
    from cuflash.bench import ring

    assert ring.parse_variant("nccl_priority+fwd_dyn+nccl_ctas4") == {
        "flags": ["FWD_DYNAMIC"], "priority": True, "max_ctas": 4, "rotate": False,
        "lib_ctas": None, "grid_steps": None}
    assert ring.parse_variant("rotate+early_send+lib_priority+lib_ctas2") == {
        "flags": ["EARLY_SEND", "PRIORITY_GROUP"], "priority": False, "max_ctas": None,
        "rotate": True, "lib_ctas": 2, "grid_steps": None}
    assert ring.parse_variant("fwd_grid1+lib_ctas4") == {
        "flags": [], "priority": False, "max_ctas": None, "rotate": False, "lib_ctas": 4,
        "grid_steps": 1}
    assert ring.parse_variant("fwd_grid0")["grid_steps"] == 0
    with pytest.raises(ValueError, match="^ab: unknown variant 'fwd_grid2' in 'fwd_grid1"):
        ring.parse_variant("fwd_grid1+fwd_grid2")
    with pytest.raises(ValueError, match="^ab: unknown variant 'fwd_grid'"):
        ring.parse_variant("fwd_grid")
    for flag in ring.FLAG_VARIANTS.values():  # every flag a variant flips exists
        assert isinstance(getattr(cfd, flag), bool)
    with pytest.raises(ValueError, match="^ab: unknown variant 'nccl_ctasx'"):
        ring.parse_variant("fwd_dyn+nccl_ctasx")
    spec = ring.parse_variant("dq_ws+bwd_groups1+fwd_groups4")
    assert spec["flags"] == ["DQ_IN_WORKSPACE"] and spec["head_groups"] == 1
    assert spec["fwd_head_groups"] == 4
    with pytest.raises(ValueError, match="^ab: unknown variant 'bwd_groups0'"):
        ring.parse_variant("bwd_groups0")
    saved = cfd.BWD_HEAD_GROUPS, cfd.DQ_IN_WORKSPACE, cfd.FWD_HEAD_GROUPS
    try:
        ring.apply_variant(spec)
        assert cfd.BWD_HEAD_GROUPS == 1 and cfd.DQ_IN_WORKSPACE is not saved[1]
        assert cfd.FWD_HEAD_GROUPS == 4
    finally:
        cfd.BWD_HEAD_GROUPS, cfd.DQ_IN_WORKSPACE, cfd.FWD_HEAD_GROUPS = saved


def test_bench_ring_timeline_lines():
    """The per-rank timeline: compute start and kernel time, wait, transfer stretch per step;
    configs once when every rank ran the same."""
    from cuflash.bench import ring

    fwd = ([("fwd_xfer", 0, 0.0, 3.0), ("fwd_compute", 0, 0.5, 20.5), ("fwd_merge", 0, 20.5, 21.0),
            ("fwd_wait", 0, 21.0, 21.0), ("fwd_xfer", 1, 3.0, 40.0), ("fwd_compute", 1, 21.0, 41.0)],
           [("fwd_config", 0, "A"), ("fwd_config", 1, "B")])
    bwd = ([("bwd_compute", 0, 0.0, 10.0), ("bwd_compute", 0, 10.0, 12.0),
            ("bwd_xfer", 0, 0.0, 1.0), ("bwd_acc_xfer", 1, 12.0, 13.0),
            ("bwd_compute", 1, 12.0, 30.0), ("bwd_home_xfer", 1, 30.0, 31.5)],
           [("bwd_config", 0, "C"), ("bwd_config", 0, "D"), ("bwd_config", 1, "C")])
    other = ([], [("fwd_config", 0, "A"), ("fwd_config", 1, "A")])
    lines = ring.timeline_lines([{"gpu": 0, "fwd": fwd, "bwd": bwd},
                                 {"gpu": 2, "fwd": ([], fwd[1]), "bwd": ([], bwd[1])},
                                 {"gpu": 1, "fwd": other, "bwd": ([], bwd[1])}])
    assert lines[0] == ("  timeline r0 (GPU 0) fwd: s0 k0.5+20.0 w0.0 x0.0-3.0 | "
                        "s1 k21.0+20.0 x3.0-40.0")
    assert lines[1] == ("  timeline r0 (GPU 0) bwd: s0 k0.0+12.0 x0.0-1.0 | "
                        "s1 k12.0+18.0 a12.0-13.0 h30.0-31.5")
    assert lines[2] == "  timeline r1 (GPU 2) fwd: "
    assert "  configs bwd (same on every rank): s0 C + D; s1 C" in lines
    assert "  configs fwd r0: s0 A; s1 B" in lines and "  configs fwd r2: s0-1 A" in lines


def test_ring_pick_variant():
    """The GPU request's glue: the candidate with the best mean gain over the ring records
    that timed it, if that gain reaches min_gain; else none."""
    from ring_pick_variant import pick

    recs = [{"impl": "ring", "tflops_per_gpu": 500.0, "alt_fwd_dyn_tflops_per_gpu": 505.0,
             "alt_lib_priority_tflops_per_gpu": 540.0},
            {"impl": "ring", "tflops_per_gpu": 550.0, "alt_lib_priority_tflops_per_gpu": 560.0},
            {"impl": "torch_cp", "tflops_per_gpu": 100.0, "alt_fwd_dyn_tflops_per_gpu": 900.0}]
    assert pick(recs, candidates=("lib_priority+fwd_dyn", "lib_priority", "fwd_dyn")) == \
        "lib_priority"
    assert pick(recs, candidates=("fwd_dyn",)) == "fwd_dyn"
    assert pick(recs, candidates=("fwd_dyn",), min_gain=1.02) == "none"
    assert pick(recs, candidates=("lib_priority+fwd_dyn",)) == "none"


def test_trace_timeline_of_cpu_entries():
    """trace_summary skips the config and origin entries; trace_timeline keeps the configs
    (no events: nothing to synchronize)."""
    trace = [("fwd_config", 0, "cfg", None)]
    assert cfd.trace_summary(trace) == {}
    assert cfd.trace_timeline(trace) == ([], [("fwd_config", 0, "cfg")])


def test_ring_group_checks_max_ctas_and_flags_default_off():
    """ring_group refuses a bad max_ctas before touching torch.distributed; the straggler's
    remedies are on by default (measured; bench --ring-ab flips them); CPU tensors, or a group
    passed in, keep the group as given."""
    import torch.distributed as dist

    assert cfd.PRIORITY_GROUP and cfd.FWD_DYNAMIC and cfd.RING_MAX_CTAS is None
    assert cfd.BWD_LOW_MEMORY and not cfd.DKV_HOME and not cfd.FWD_DYNAMIC_CAUSAL
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="^max_ctas"):
            cfd.ring_group(max_ctas=bad)
    if not hasattr(dist, "ProcessGroupNCCL"):
        with pytest.raises(RuntimeError, match="^ring_group: this torch has no NCCL"):
            cfd.ring_group()
    assert cfd._transfer_group(None, torch.device("cpu")) is None  # CPU tensors (gloo)
    given = object()
    assert cfd._transfer_group(given, torch.device("cuda", 0)) is given  # a group passed in
    try:
        cfd.PRIORITY_GROUP = False
        assert cfd._transfer_group(None, torch.device("cuda", 0)) is None
    finally:
        cfd.PRIORITY_GROUP = True


def test_trace_records_nothing_for_cpu_tensors():
    """cuflash.distributed.TRACE (bench --ring-breakdown) times CUDA streams only: a CPU ring
    records nothing, and with TRACE off nothing is recorded either."""
    x = torch.zeros(1)
    try:
        cfd.TRACE = []
        with cfd._Span("fwd_compute", 0, x):
            pass
        assert cfd.TRACE == [] and cfd.trace_summary(cfd.TRACE) == {}
    finally:
        cfd.TRACE = None
    with cfd._Span("fwd_compute", 0, x) as span:
        assert span.key is None


def test_bench_ring_without_gpu_raises_no_gpu_error(tmp_path):
    from cuflash import _gpu, bench

    if not _gpu.why_unavailable():
        pytest.skip("a GPU is usable: the mode would run")
    with pytest.raises(_gpu.NoGPUError):
        bench.main(["--mode", "ring", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_bench_ring_flops():
    from cuflash.bench import ring
    from cuflash.problem import Problem
    from cuflash.registry import op_flops

    for causal in (False, True):
        for op in ("fwd", "bwd"):
            p = Problem(op, "bf16", 1, 4096, 4096, 8, 8, 128, causal)
            assert ring.flops(1, 8, 4096, 128, causal, op) == op_flops(p)


def test_zigzag_odd_seqlen_local_is_refused_causal_or_not():
    """An odd shard cannot be two equal zigzag chunks: the last row and key were dropped
    (out row 0) without causal; now an error naming q, before any transfer."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
        for causal in (False, True):
            with pytest.raises(ValueError, match=r"^q: zigzag needs an even seqlen_local"):
                cfd.ring_flash_attn_func(q, q, q, causal=causal)
        out = cfd.ring_flash_attn_func(q, q, q, layout="contiguous")   # one chunk: any length
        assert out.shape == q.shape and bool(out[:, -1].abs().sum() > 0)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# varlen: pure functions and argument checks

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_varlen_shard_round_trip(world, layout):
    n = cfd.chunk_count(world, layout)
    lens = [0, n, 3 * n, 0, 5 * n]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    total = int(cu[-1])
    x = torch.arange(total * 6).reshape(total, 2, 3)
    lse = torch.arange(2 * total).reshape(2, total).float()
    shards, lse_shards = [], []
    for r in range(world):
        local, local_cu = cfd.varlen_shard(x, cu, r, world, layout)
        assert local.shape == (total // world, 2, 3) and local_cu.dtype == torch.int32
        chunks = cfd.chunk_ids(r, world, layout)
        # local_cu: one piece per (local chunk, sequence), in local order
        assert local_cu.tolist() == np.concatenate(
            [[0], np.cumsum([m // n for _ in chunks for m in lens])]).tolist()
        for p, (c, i) in enumerate((c, i) for c in chunks for i in range(len(lens))):
            m = lens[i] // n
            want = x[int(cu[i]) + c * m:int(cu[i]) + (c + 1) * m]
            assert torch.equal(local[int(local_cu[p]):int(local_cu[p + 1])], want)
        shards.append(local)
        lse_shards.append(cfd.varlen_shard(lse, cu, r, world, layout, dim=1)[0])
    assert torch.equal(cfd.varlen_unshard(shards, cu, world, layout), x)
    assert torch.equal(cfd.varlen_unshard(lse_shards, cu, world, layout, dim=1), lse)


def test_varlen_shard_errors_name_the_argument():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    x = torch.zeros(10, 2, 8)
    with pytest.raises(ValueError, match=r"^cu_seqlens: every sequence length must be a multiple "
                                         r"of 4 .*sequence 1 has 6 tokens"):
        cfd.varlen_shard(x, cu, 0, 2)
    cfd.varlen_shard(x, cu, 0, 2, "contiguous")  # multiples of P = 2: fine
    with pytest.raises(TypeError, match="^cu_seqlens: dtype must be int32"):
        cfd.varlen_shard(x, cu.long(), 0, 2, "contiguous")
    with pytest.raises(ValueError, match="^cu_seqlens: must start at 0"):
        cfd.varlen_shard(x, torch.tensor([0, 6, 4], dtype=torch.int32), 0, 2, "contiguous")
    with pytest.raises(ValueError, match="^x: its length along dim 0"):
        cfd.varlen_shard(x[:8], cu, 0, 2, "contiguous")
    with pytest.raises(ValueError, match="^layout"):
        cfd.varlen_shard(x, cu, 0, 2, "striped")
    with pytest.raises(ValueError, match="^rank"):
        cfd.varlen_shard(x, cu, 2, 2, "contiguous")
    s = [cfd.varlen_shard(x, cu, r, 2, "contiguous")[0] for r in range(2)]
    with pytest.raises(ValueError, match=r"^shards: expected one tensor per rank"):
        cfd.varlen_unshard(s[:1], cu, 2, "contiguous")
    with pytest.raises(ValueError, match=r"^shards\[1\]"):
        cfd.varlen_unshard([s[0], s[1][:4]], cu, 2, "contiguous")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_step_calls_cover_exactly_the_visible_pairs(world, layout, causal):
    """Over the P steps, each rank's varlen calls (one chunk pair each) cover every visible
    (q chunk, k chunk) pair of a sequence exactly once, diagonal pairs with the causal mask."""
    nchunks = cfd.chunk_count(world, layout)
    covered = np.zeros((nchunks, nchunks), int)
    for rank in range(world):
        qc = cfd.chunk_ids(rank, world, layout)
        for step in range(world):
            kc = cfd.chunk_ids((rank - step) % world, world, layout)
            for call in cfd.varlen_step_calls(qc, kc, causal):
                assert call.q1 == call.q0 + 1 and call.k1 == call.k0 + 1
                a, b = qc[call.q0], kc[call.k0]
                assert call.causal == (causal and a == b)
                covered[a, b] += 1
    want = np.tril(np.ones((nchunks, nchunks), int)) if causal else np.ones((nchunks, nchunks), int)
    assert np.array_equal(covered, want)


def test_ring_varlen_args_are_checked_before_any_transfer():
    import torch.distributed as dist

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="^layout"):
        cfd.ring_flash_attn_varlen_func(q, q, q, cu, 6, layout="striped")
    with pytest.raises(RuntimeError, match="^group"):
        cfd.ring_flash_attn_varlen_func(q, q, q, cu, 6)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="^q: expected 3 dims"):
            cfd.ring_flash_attn_varlen_func(q[None], q, q, cu, 6)
        with pytest.raises(ValueError, match="^k: total_local"):
            cfd.ring_flash_attn_varlen_func(q, q[:8], q[:8], cu, 6)
        with pytest.raises(TypeError, match="^cu_seqlens"):
            cfd.ring_flash_attn_varlen_func(q, q, q, cu.long(), 6)
        with pytest.raises(ValueError, match="^cu_seqlens: expected the GLOBAL"):
            cfd.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 4, 8], dtype=torch.int32), 6)
        with pytest.raises(ValueError, match="^cu_seqlens: every sequence length must be a "
                                             "multiple of 2"):
            cfd.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 3, 10], dtype=torch.int32), 7)
        with pytest.raises(ValueError, match="^max_seqlen"):
            cfd.ring_flash_attn_varlen_func(q, q, q, cu, 4)
        import cuflash

        want = cuflash.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True)
        for layout in cfd.LAYOUTS:  # P = 1: plain varlen attention, in the local order
            out = cfd.ring_flash_attn_varlen_func(*(cfd.varlen_shard(q, cu, 0, 1, layout)[0],) * 3,
                                                  cu, 6, causal=True, layout=layout)
            assert (cfd.varlen_unshard([out], cu, 1, layout) - want).abs().max().item() < 1e-6
    finally:
        dist.destroy_process_group()


def test_bench_ring_variant_flow(monkeypatch):
    """bench ring's _variant without GPUs (timing and tracing stubbed): the flags flip for the
    variant's calls and come back, the warm-up ring runs small, the breakdown's timeline is
    logged under the variant's name; an unknown name becomes an alt_<name>_error field."""
    from cuflash.bench import ring

    calls, logged = [], []
    monkeypatch.setattr(ring, "_timed", lambda fn, reps: (fn(), 2.0)[1])
    monkeypatch.setattr(ring, "_breakdown", lambda world, f, b: (f(), b(), {
        "trace_wait_ms": 1.5, "timeline_lines": ["  timeline r0 (GPU 0) fwd: s0 k0.0+1.0"]})[2])

    def fwd(group=None, comm=True, n=None):
        calls.append(("fwd", n, cfd.FWD_DYNAMIC, cfd.PRIORITY_GROUP))
        return ("out", "lse")

    def bwd(res, group=None, comm=True, n=None):
        calls.append(("bwd", n, cfd.FWD_DYNAMIC, cfd.PRIORITY_GROUP))

    rec = {"fwd_ms": 1.0, "bwd_ms": 3.0}
    out = ring._variant("fwd_dyn+lib_priority", 2, 3, 8e9, rec, logged.append, fwd, bwd, 64, True)
    assert out["alt_fwd_dyn+lib_priority_fwd_ms"] == 2.0 and out[
        "alt_fwd_dyn+lib_priority_tflops_per_gpu"] == 8e9 / 2 / 4.0 / 1e9
    assert out["alt_fwd_dyn+lib_priority_trace_wait_ms"] == 1.5
    assert calls[0] == ("fwd", 64, False, False) and calls[1] == ("bwd", 64, False, False)
    assert all(c[2:] == (False, False) for c in calls) and {c[1] for c in calls[2:]} == {None}
    assert cfd.FWD_DYNAMIC and cfd.PRIORITY_GROUP
    seen = []
    ring._variant("lib_ctas2", 2, 3, 8e9, rec, logged.append,
                  lambda *a, **k: seen.append(cfd.RING_MAX_CTAS), lambda *a, **k: None, 64)
    assert set(seen) == {2} and cfd.RING_MAX_CTAS is None
    seen = []
    ring._variant("fwd_grid2+lib_ctas4", 2, 3, 8e9, rec, logged.append,
                  lambda *a, **k: seen.append((cfd.FWD_GRID_STEPS, cfd.RING_MAX_CTAS)),
                  lambda *a, **k: None, 64)
    assert set(seen) == {(2, 4)} and cfd.FWD_GRID_STEPS == 0 and cfd.RING_MAX_CTAS is None
    assert logged[-1].startswith("  fwd_grid2+lib_ctas4 (cuflash.distributed.FWD_GRID_STEPS = N")
    assert logged[0].startswith("  fwd_dyn+lib_priority (") and \
        logged[1] == "  [fwd_dyn+lib_priority] timeline r0 (GPU 0) fwd: s0 k0.0+1.0"
    out = ring._variant("nope", 2, 3, 8e9, rec, logged.append, fwd, bwd, 64)
    assert list(out) == ["alt_nope_error"] and "unknown variant 'nope'" in out["alt_nope_error"]


def test_bench_ring_ab_here():
    """--ring-ab's problems: every one by default; --ring-ab-max, --ring-ab-seqlens and
    --ring-ab-causal each narrow them."""
    from cuflash.bench import ring

    assert ring.ab_here({}, 1 << 20, True) and ring.ab_here({"ab_causals": (True, False)}, 8, False)
    opts = {"ab_max": 524288, "ab_seqlens": (262144, 524288, 1048576), "ab_causals": (False,)}
    assert ring.ab_here(opts, 524288, False)
    assert not ring.ab_here(opts, 524288, True) and not ring.ab_here(opts, 1048576, False)
    assert not ring.ab_here(dict(opts, ab_max=None), 131072, False)
    assert ring.ab_here(dict(opts, ab_max=None), 1048576, False)


def test_forward_config_grid_and_dynamic(monkeypatch):
    """block_forward's config changes (no GPU: selection and the device's shared memory stubbed):
    FWD_GRID_STEPS puts a non-causal call of the first steps on a grid of one CTA per tile where
    selection picks a persistent schedule (static or dynamic), leaves causal calls and later
    steps to FWD_DYNAMIC; FWD_DYNAMIC alone moves a static persistent config to the dynamic
    scheduler. The plain instantiation is untouched when both are off."""
    from cuflash import _gpu, select
    from cuflash.families.sm90_fwd import Sm90FwdConfig

    static = Sm90FwdConfig(128, 176, 2, 2, True, True, 128, "bf16", False)
    dyn = static.replace(dynamic=True)

    class Fam:
        @staticmethod
        def fits(config, problem):
            return None

    picks = {}
    monkeypatch.setattr(select, "choose_on_device",
                        lambda problem, dev: (Fam, picks[bool(problem.causal)], None))
    monkeypatch.setattr(_gpu, "max_smem", lambda dev=None: 232448)
    monkeypatch.setattr(cfd, "_dynamic_configs", {})
    q = torch.zeros(1, 4096, 2, 128, dtype=torch.bfloat16)
    picks[False], picks[True] = static, dyn.replace(causal=True)
    grid = cfd._forward_config(q, q, q, 0.1, False, True)
    assert not grid.persistent and not grid.dynamic and grid.BN == 176 and grid.pingpong
    assert cfd._forward_config(q, q, q, 0.1, False, False) == dyn
    causal = cfd._forward_config(q, q, q, 0.1, True, False)
    assert causal is None  # already dynamic: selection's own
    monkeypatch.setattr(cfd, "_dynamic_configs", {})
    picks[False] = dyn
    assert cfd._forward_config(q, q, q, 0.1, False, True) == grid  # from the dynamic one too
    assert cfd._forward_config(q, q, q, 0.1, False, False) is None
    picks[False] = grid
    monkeypatch.setattr(cfd, "_dynamic_configs", {})
    assert cfd._forward_config(q, q, q, 0.1, False, True) is None  # already a grid
    assert cfd.FWD_GRID_STEPS == 0  # off until measured (bench --ring-ab fwd_gridN)


def test_bench_ring_tables(tmp_path, capsys):
    """The README's ring table and the peak-memory table from ring.json records: a row per ring
    record (skipped ones say so), torch CP by backend (none named: flash), the 1/P ratios; the
    README block between the markers rewritten, GPU kind and P from the folder names."""
    import json

    from cuflash.bench import ring

    assert ring.gpu_of_dir("NVIDIA_H200x4") == ("H200", 4)
    assert ring.gpu_of_dir("NVIDIA_H100_80GB_HBM3x2") == ("H100", 2)
    assert ring.gpu_of_dir("logs") == ("logs", None)
    gib = 2 ** 30
    two = [{"impl": "ring", "P": 2, "seqlen": 262144, "causal": False, "tflops_per_gpu": 540.4,
            "efficiency": 0.987, "peak_bytes_per_gpu": 5 * gib},
           {"impl": "ring", "P": 2, "seqlen": 262144, "causal": True, "tflops_per_gpu": 530.0},
           {"impl": "torch_cp", "seqlen": 262144, "causal": False, "backend": "cudnn",
            "tflops_per_gpu": 520.2},
           {"impl": "torch_cp", "seqlen": 262144, "causal": False, "tflops_per_gpu": 315.0},
           {"impl": "cuflash_1gpu", "P": 1, "seqlen": 262144, "causal": False, "peak_bytes": 3 * gib},
           {"impl": "ring", "P": 2, "seqlen": 1048576, "causal": False, "skipped": "budget"}]
    four = [{"impl": "ring", "P": 4, "seqlen": 262144, "causal": False, "tflops_per_gpu": 500.0,
             "peak_bytes_per_gpu": 2.75 * gib}]
    runs = [("H200", 2, "", two), ("H200", 4, "earlier ring", four)]
    lines = ring.table_lines(runs)
    assert lines[2] == "| 2 H200 | 256k | causal | 530 | — | — | — | — |"
    assert lines[3] == "| 2 H200 | 256k | non-causal | 540 | 0.99 | 315 | 520 | 5.00 |"
    assert lines[4] == "| 2 H200 | 1M | non-causal | skipped | — | — | — | — |"
    assert lines[5] == "| 4 H200 (earlier ring) | 256k | non-causal | 500 | — | — | — | 2.75 |"
    mem = ring.memory_lines(runs)
    assert mem[0] == "| GPU | seqlen | mask | P = 1 | P = 2 | P = 4 |"
    assert mem[2] == "| H200 | 256k | non-causal | 3.00 | 5.00 (3.33) | 2.75 (3.67) |" and len(mem) == 3
    text = "intro\n" + ring.README_START + "\nold\n" + ring.README_END + "\nrest\n"
    assert ring.replace_block(text, ["a", "b"]) == ("intro\n" + ring.README_START + "\na\nb\n"
                                                    + ring.README_END + "\nrest\n")
    with pytest.raises(ValueError, match="^readme: expected the markers"):
        ring.replace_block("no markers", ["a"])
    folder = tmp_path / "NVIDIA_H200x2" / "logs"
    folder.mkdir(parents=True)
    (folder / "ring.json").write_text(json.dumps({"records": two}))
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert ring.main(["--table", f"{folder / 'ring.json'}=new"]) == 0
    assert "| 2 H200 (new) | 256k | non-causal | 540 |" in capsys.readouterr().out
    assert ring.main(["--table", str(folder / "ring.json"), "--readme", str(readme)]) == 0
    body = readme.read_text()
    assert body.startswith("intro\n" + ring.README_START + "\n| GPUs |") and body.endswith(
        ring.README_END + "\nrest\n") and "| 2 H200 | 1M | non-causal | skipped |" in body


def test_bench_ring_worker_loop(monkeypatch):
    """bench ring's per-process loop without GPUs (the measurements, collectives and CUDA calls
    stubbed): problems in the order given, the budget's estimates scaled from the last problem
    (less its A/B seconds; light <-> full by LIGHT_COST), skipped problems recorded, the records
    rewritten after every problem and once more (with the plot) at the end."""
    import torch.distributed as dist

    from cuflash.bench import ring

    clock = {"t": 0.0}
    monkeypatch.setattr(ring.time, "perf_counter", lambda: clock["t"])
    cost = {(1 << 20, True): 40.0, (1 << 20, False): 80.0, (1 << 19, True): 10.0,
            (1 << 19, False): 20.0, (1 << 18, True): 8.0, (1 << 18, False): 16.0}
    seen, writes = [], []

    def measure(rank, world, seqlen, causal, opts, log, base):
        seen.append((seqlen, causal))
        ab = 7.0 if (seqlen, causal) == (1 << 19, False) else 0.0
        clock["t"] += cost[(seqlen, causal)] + ab
        return [dict(impl="ring", **base, tflops_per_gpu=1.0, **({"ab_seconds": ab} if ab else {}))]

    monkeypatch.setattr(ring, "_init", lambda *a: None)
    monkeypatch.setattr(ring, "_measure", measure)
    monkeypatch.setattr(ring, "_agree", lambda value: value)
    monkeypatch.setattr(ring, "_max_over_ranks", lambda x: x)
    monkeypatch.setattr(ring, "_write", lambda records, world, out, log, png=True:
                        writes.append((len(records), png)))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    opts = dict(seqlens=(1 << 20, 1 << 19, 1 << 18), causals=(True, False), budget_s=175.0,
                full_max=0, out="unused", light_from=1 << 18, d=128, nheads=8)
    ring._worker(0, 2, 0, opts)
    # 1M causal 40 s; 1M non-causal est 80 -> 120 s; 512k causal est 10 -> 130; 512k non-causal
    # est 20 (its 7 s of A/B not in the estimate of what follows) -> 157; 256k causal est
    # 10 / 4 / LIGHT_COST = 5.6 -> 165; 256k non-causal est 20 / 4 / 0.45 = 11.1 -> 176 > 175
    assert seen == [(1 << 20, True), (1 << 20, False), (1 << 19, True), (1 << 19, False),
                    (1 << 18, True)]
    assert writes == [(1, False), (2, False), (3, False), (4, False), (5, False), (6, True)]
    assert ring._light_factor(True, False) == ring.LIGHT_COST
    assert ring._light_factor(False, True) == 1 / ring.LIGHT_COST and ring._light_factor(True, True) == 1


def test_block_forward_schedule_flags(monkeypatch):
    """Which config changes block_forward asks for: FWD_DYNAMIC from FWD_DYNAMIC_MIN_WORLD ranks
    up (world 0: any ring), FWD_GRID_STEPS for the non-causal calls of the first steps; neither:
    selection's own config (no _forward_config call)."""
    from cuflash import torch_ops

    asked = []
    monkeypatch.setattr(cfd, "_forward_config",
                        lambda q, k, v, scale, causal, grid=False: asked.append((causal, grid)) or "cfg")
    monkeypatch.setattr(torch_ops, "_forward", lambda q, k, v, scale, causal, config, _: (config, None, None))

    class Cuda:
        is_cuda = True

    q = Cuda()
    assert cfd.FWD_DYNAMIC and cfd.FWD_DYNAMIC_MIN_WORLD == 3 and cfd.FWD_GRID_STEPS == 0
    assert cfd.FWD_FULL_GRID_STEPS == 1  # (the default since session 19; FWD_DYNAMIC alone first)
    monkeypatch.setattr(cfd, "FWD_FULL_GRID_STEPS", 0)
    assert cfd.block_forward(q, q, q, 0.1, False, 0, 2)[0] is None
    assert asked == []  # 2 ranks: static persistent as selected
    assert cfd.block_forward(q, q, q, 0.1, False, 1, 2)[0] is None
    assert cfd.block_forward(q, q, q, 0.1, False, 0, 3)[0] == "cfg" and asked == [(False, False)]
    # a causal ring (the call's causal by default) only with FWD_DYNAMIC_CAUSAL
    assert cfd.block_forward(q, q, q, 0.1, True, 0)[0] is None and len(asked) == 1
    assert cfd.block_forward(q, q, q, 0.1, False, 1, 4, True)[0] is None and len(asked) == 1
    monkeypatch.setattr(cfd, "FWD_DYNAMIC_CAUSAL", True)
    assert cfd.block_forward(q, q, q, 0.1, True, 0)[0] == "cfg" and asked[-1] == (True, False)
    monkeypatch.setattr(cfd, "FWD_DYNAMIC_CAUSAL", False)
    monkeypatch.setattr(cfd, "FWD_GRID_STEPS", 1)
    asked.clear()
    cfd.block_forward(q, q, q, 0.1, False, 0, 2)
    cfd.block_forward(q, q, q, 0.1, False, 1, 2)
    cfd.block_forward(q, q, q, 0.1, True, 0, 4)
    cfd.block_forward(q, q, q, 0.1, False, 1, 4)
    assert asked == [(False, True), (False, False)]
    # FWD_FULL_GRID_STEPS: non-causal rings from FWD_DYNAMIC_MIN_WORLD ranks up only; the first
    # steps on the grid, the later ones as selected (no FWD_DYNAMIC); causal rings unchanged
    monkeypatch.setattr(cfd, "FWD_GRID_STEPS", 0)
    monkeypatch.setattr(cfd, "FWD_FULL_GRID_STEPS", 1)
    asked.clear()
    assert cfd.block_forward(q, q, q, 0.1, False, 0, 4, False)[0] == "cfg"
    assert cfd.block_forward(q, q, q, 0.1, False, 1, 4, False)[0] is None
    assert cfd.block_forward(q, q, q, 0.1, False, 0, 2, False)[0] is None
    assert asked == [(False, True)]
    cfd.block_forward(q, q, q, 0.1, False, 0, 4, True)   # a causal ring's half-block calls
    cfd.block_forward(q, q, q, 0.1, True, 0, 4, True)
    assert asked == [(False, True)]


def test_plan_run_roles_launches_only_those_roles(monkeypatch):
    """launch.Plan.run_roles (DQ_IN_WORKSPACE's launches): only the named roles' kernels, in the
    plan's order, with the workspace pieces' addresses packed as run() packs them."""
    from types import SimpleNamespace

    from cuflash import _gpu, launch
    from cuflash.families.fa2_bwd import FAMILY as fam
    from cuflash.problem import Problem

    problem = Problem("bwd", "bf16", 1, 256, 256, 2, 2, 64, False)
    config = fam.heuristic(problem, (8, 0))
    roles = [spec.role for spec in fam.launches(config, problem, 108)]
    ptr_of = {role: 1000 + i for i, role in enumerate(roles)}
    monkeypatch.setattr(launch, "get_kernels", lambda cfg, dev: {
        r: SimpleNamespace(kernel=SimpleNamespace(ptr=ptr_of[r])) for r in roles})
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 108)
    launched = []
    monkeypatch.setattr(launch, "_driver_launch", lambda: lambda fn, *a: launched.append(fn))
    monkeypatch.setattr(launch, "_device_fns", lambda: ((lambda: 0), (lambda d: None)))
    strides = {name: (256 * 2 * 64, 2 * 64, 64, 1) for name in ("dout", "q", "k", "v", "o", "dq",
                                                                "dk", "dv")}
    plan = launch.Plan(fam, config, problem, strides, 0.125, 0)
    assert roles[:3] == ["preprocess", "main", "convert_dq"]
    plan.run_roles(("main",), tuple(range(1, 10)), 1 << 20, 0)
    assert launched == [ptr_of["main"]]
    launched.clear()
    plan.run_roles(("convert_dq", "preprocess"), tuple(range(1, 10)), 1 << 20, 0)
    assert launched == [ptr_of["preprocess"], ptr_of["convert_dq"]]
    # the workspace pieces follow the op's tensors at the plan's offsets
    names = fam.pointer_fields
    packed = plan._record[names[names.index("dq_accum")]]
    assert packed == (1 << 20) + plan.workspace_offsets["dq_accum"]
    launched.clear()
    plan.run(tuple(range(1, 10)), 1 << 20, 0)
    assert launched == [ptr_of[r] for r in roles]


class _FakeAccPlan:
    """A stand-in for a backward Plan on CPU float32 tensors (test_dq_sum_orchestration): the
    fa2_bwd workspace layout, and run_roles doing each role's work through the pointers (the
    float64 block gradient for main, unscaled dQ added into the workspace's accumulator)."""

    def __init__(self, dout, q, k, causal, scale, det):
        from types import SimpleNamespace

        b, sq, h, d = q.shape
        self.shapes = (q.shape, k.shape)
        self.dout_strides = dout.stride()  # (a real plan is made for dout's strides too)
        self.causal, self.scale, self.device = causal, scale, 0
        rows = -(-sq // 128) * 128
        self.problem = SimpleNamespace(batch=b, nheads=h, seqlen_q=sq)
        self.config = SimpleNamespace(head_dim=d, name="fake", dq_first=False, dq_convert=False)
        sizes = {"lse_log2": b * h * rows * 4, "D": b * h * rows * 4,
                 "dq_accum": b * h * rows * d * 4}
        if det:
            sizes["dq_semaphore"] = b * h * (rows // 16) * 4
        self.workspace_offsets, total = {}, 0
        for name, size in sizes.items():
            self.workspace_offsets[name] = total
            total += -(-size // 256) * 256
        self.workspace_offsets["total"] = self.workspace_bytes = total
        self.rows = rows
        self.ran = []

    @staticmethod
    def _view(ptr, shape):
        import ctypes

        n = int(np.prod(shape))
        return np.frombuffer((ctypes.c_float * n).from_address(ptr), np.float32).reshape(shape)

    def run_roles(self, roles, ptrs, ws, stream):
        qs, ks = self.shapes
        b, sq, h, d = qs
        acc = self._view(ws + self.workspace_offsets["dq_accum"], (b, h, self.rows, d))
        self.ran.append(tuple(r for r in ("preprocess", "main", "convert_dq") if r in roles))
        if "preprocess" in roles:
            acc[...] = 0.0
        if "main" in roles:
            t = [torch.from_numpy(self._view(p, s).copy()) for p, s in
                 zip(ptrs[1:5], (qs, ks, ks, qs))]
            st = self.dout_strides
            extent = 1 + sum((n - 1) * s for n, s in zip(qs, st))
            t.insert(0, torch.from_numpy(self._view(ptrs[0], (extent,))).as_strided(qs, st).clone())
            lse = torch.from_numpy(self._view(ptrs[5], (b, h, sq)).copy())
            dq, dk, dv = cfd.reference_block_backward(*t, lse, self.scale, self.causal)
            acc[:, :, :sq] += (dq.double() / self.scale).permute(0, 2, 1, 3).numpy()
            self._view(ptrs[7], ks)[...] = dk.numpy()
            self._view(ptrs[8], ks)[...] = dv.numpy()
        if "convert_dq" in roles:
            self._view(ptrs[6], qs)[...] = (acc[:, :, :sq] * self.scale).transpose(0, 2, 1, 3)


def test_dq_sum_orchestration(monkeypatch):
    """_DqSum's workspace path (DQ_IN_WORKSPACE; CUDA only, here on a CPU stand-in plan): the
    first all-rows call runs the preprocess, later all-rows calls the main kernel alone on the
    same workspace, some-rows calls their own workspace added in, one convert at the end; dq, dk,
    dv as the plain path's (float32 here, so to rounding)."""
    from cuflash import torch_ops

    plans = {}

    def fake_plan(dout, q, k, v, out, lse, scale, causal, det):
        key = (q.shape, k.shape, causal, det)
        if key not in plans:
            plans[key] = _FakeAccPlan(dout, q, k, causal, scale, det)
        return plans[key]

    monkeypatch.setattr(cfd, "_acc_plan", fake_plan)
    monkeypatch.setattr(torch_ops, "_raw_stream", lambda device: 0)
    g = torch.Generator().manual_seed(5)
    b, n, h, hk, d = 2, 96, 4, 2, 16
    q, dout, out = (torch.randn(b, n, h, d, generator=g) for _ in range(3))
    blocks = [(torch.randn(b, n, hk, d, generator=g), torch.randn(b, n, hk, d, generator=g))
              for _ in range(3)]
    lse = torch.randn(b, h, n, generator=g).abs() + 8
    scale = d ** -0.5
    half = n // 2
    calls = [(slice(0, n), slice(0, n), True, True), (slice(0, n), slice(0, half), False, True),
             (slice(half, n), slice(0, n), False, False), (slice(0, n), slice(0, n), False, True)]
    for det in (False, True):
        sums = cfd._DqSum(q, scale, False)
        sums.in_workspace = True  # (CPU: the stand-in plans)
        plain = cfd._DqSum(q, scale, False)
        for (rows, ks, causal, all_rows), (k, v) in zip(calls, blocks + blocks[:1]):
            args = (dout[:, rows], q[:, rows], k[:, ks], v[:, ks], out[:, rows],
                    lse[:, :, rows].contiguous(), causal, det, rows, all_rows)
            got, want = sums.block(*args), plain.block(*args)
            for a, w in zip(got, want):
                assert torch.allclose(a, w, atol=1e-5), (rows, ks)
        assert sums.ws is not None and plain.ws is None
        assert torch.allclose(sums.result(), plain.result(), atol=1e-5)
        first = plans[((b, n, h, d), (b, n, hk, d), True, det)]
        assert first.ran == [("preprocess", "main"), ("convert_dq",)]
        assert plans[((b, n, h, d), (b, half, hk, d), False, det)].ran == [("main",)]
        assert plans[((b, half, h, d), (b, n, hk, d), False, det)].ran == [("preprocess", "main")]
        assert plans[((b, n, h, d), (b, n, hk, d), False, det)].ran == [("main",)]
        plans.clear()
