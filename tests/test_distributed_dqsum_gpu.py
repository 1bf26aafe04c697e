"""The ring backward's dQ sums in the kernels' workspace (cuflash.distributed.DQ_IN_WORKSPACE) on
one GPU, no process group: a rank's block calls as a ring step makes them (every local q row on
a whole block, on a half block, and some rows only), added into one _DqSum, against the float64
block gradients (the global out and lse given) and against the plain path (each call's dq
rounded to q's dtype, summed in fp32), whose error bounds the new one (2x, plus one ulp of the
largest value). dK and dV of every call must match the plain path's; deterministic calls must
be bitwise reproducible. The same calls per group of heads (BWD_HEAD_GROUPS: strided head views
read in place, one _DqSum per group) within the same bounds. Outputs are NaN-poisoned before each
launch.

    timeout 120 python -m pytest -q -s tests/test_distributed_dqsum_gpu.py
"""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

# (batch, chunk, nheads, nheads_kv, headdim, causal, deterministic)
CASES = [
    (2, 256, 4, 4, 128, False, False),
    (1, 256, 4, 2, 128, True, True),     # GQA, ordered dQ additions
    (1, 192, 2, 1, 64, False, False),    # MQA, d64, rows not a multiple of 128 per half
    (1, 256, 4, 4, 128, True, False),
]


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch


def _calls(n, causal):
    """(q rows, k rows, causal, all rows) of three calls as a ring makes them: the own block
    (causal in a causal ring), a whole or half block over every row, a block over the second
    half of the rows."""
    half = n // 2
    return [(slice(0, n), slice(0, n), causal, True),
            (slice(0, n), slice(0, half) if causal else slice(0, n), False, True),
            (slice(half, n), slice(0, n), False, False)]


def _inputs(torch, case, seed):
    b, c, h, hk, d, causal, _ = case
    n = 2 * c
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    q, dout = (torch.randn(b, n, h, d, device="cuda", dtype=bf, generator=g) for _ in range(2))
    blocks = [tuple(torch.randn(b, n, hk, d, device="cuda", dtype=bf, generator=g) for _ in range(2))
              for _ in range(3)]
    return q, dout, blocks


def _global_out_lse(torch, q, blocks, calls, scale):
    """out, lse of q over every key the calls see (float64 on the CPU), as the ring's forward
    gives them: out in q's dtype, lse fp32."""
    f64 = torch.float64
    b, n, h, d = q.shape
    qh = q.cpu().to(f64).permute(0, 2, 1, 3)
    scores, values = [], []
    for (rows, ks, causal, _), (k, v) in zip(calls, blocks):
        g = h // k.shape[2]
        kh = k[:, ks].cpu().to(f64).permute(0, 2, 1, 3).repeat_interleave(g, 1)
        vh = v[:, ks].cpu().to(f64).permute(0, 2, 1, 3).repeat_interleave(g, 1)
        s = torch.full((b, h, n, kh.shape[2]), -math.inf, dtype=f64)
        part = scale * qh[:, :, rows] @ kh.transpose(-1, -2)
        if causal:
            sq, sk = part.shape[-2:]
            keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
            part = part.masked_fill(~keep, -math.inf)
        s[:, :, rows] = part
        scores.append(s)
        values.append(vh)
    s = torch.cat(scores, -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = (p @ torch.cat(values, 2)).permute(0, 2, 1, 3)
    return out.to(q.dtype).cuda(), lse.float().cuda()


def _run(torch, cfd, case, q, dout, blocks, out, lse, scale, in_workspace):
    """(dq, [(dk, dv) per call]) through one _DqSum (in_workspace) or the plain path."""
    _, _, _, _, _, causal, det = case
    calls = _calls(q.shape[1], causal)
    sums = cfd._DqSum(q, scale, in_workspace)
    grads, dq_plain = [], torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    for (rows, ks, call_causal, all_rows), (k, v) in zip(calls, blocks):
        lse_q = lse[:, :, rows].contiguous()
        args = (dout[:, rows], q[:, rows], k[:, ks], v[:, ks], out[:, rows], lse_q)
        if in_workspace:
            grads.append(sums.block(*args, call_causal, det, rows, all_rows))
        else:
            dq_b, dk_b, dv_b = cfd.block_backward(*args, scale, call_causal, det)
            dq_plain[:, rows] += dq_b
            grads.append((dk_b, dv_b))
    dq = sums.result() if in_workspace else dq_plain.to(q.dtype)
    return dq, grads, sums


def _run_groups(torch, cfd, case, q, dout, blocks, out, lse, scale, groups):
    """_run's workspace path per head group as BWD_HEAD_GROUPS makes the calls: one _DqSum per
    group on head views of q (strided, read in place), dq and every call's dK, dV put together."""
    _, _, h, hk, _, causal, det = case
    calls = _calls(q.shape[1], causal)
    dq = torch.full(q.shape, math.nan, dtype=q.dtype, device="cuda")
    grads = [tuple(torch.full(k[:, ks].shape, math.nan, dtype=k.dtype, device="cuda")
                   for _ in range(2)) for (_, ks, _, _), (k, _) in zip(calls, blocks)]
    all_sums = []
    for g in range(groups):
        hs, hks = slice(g * h // groups, (g + 1) * h // groups), \
            slice(g * hk // groups, (g + 1) * hk // groups)
        sums = cfd._DqSum(q[:, :, hs], scale, True)
        for i, ((rows, ks, call_causal, all_rows), (k, v)) in enumerate(zip(calls, blocks)):
            lse_q = lse[:, hs][:, :, rows].contiguous()
            dk_b, dv_b = sums.block(dout[:, rows, hs], q[:, rows, hs], k[:, ks, hks],
                                    v[:, ks, hks], out[:, rows, hs], lse_q, call_causal, det,
                                    rows, all_rows, strided=True)
            grads[i][0][:, :, hks] = dk_b
            grads[i][1][:, :, hks] = dv_b
        dq[:, :, hs] = sums.result()
        all_sums.append(sums)
    return dq, grads, all_sums


def _reference(torch, cfd, case, q, dout, blocks, out, lse, scale):
    calls = _calls(q.shape[1], case[5])
    cpu = lambda x: x.cpu()  # noqa: E731
    dq = torch.zeros(q.shape, dtype=torch.float64)
    grads = []
    for (rows, ks, call_causal, _), (k, v) in zip(calls, blocks):
        f64 = lambda x: cpu(x).to(torch.float64)  # noqa: E731
        dq_b, dk_b, dv_b = cfd.reference_block_backward(
            f64(dout[:, rows]), f64(q[:, rows]), f64(k[:, ks]), f64(v[:, ks]), f64(out[:, rows]),
            cpu(lse[:, :, rows]).double(), scale, call_causal)
        dq[:, rows] += dq_b
        grads.append((dk_b, dv_b))
    return dq, grads


def _err(torch, got, want):
    return (got.double().cpu() - want).abs().max().item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_c{}_h{}-{}_d{}_{}{}".format(
    c[0], c[1], c[2], c[3], c[4], "causal" if c[5] else "full", "_det" if c[6] else ""))
def test_dq_sums_in_workspace(case):
    torch = _torch()
    from cuflash import api
    from cuflash import distributed as cfd

    saved = api.POISON_OUTPUTS
    api.POISON_OUTPUTS = True
    try:
        scale = case[4] ** -0.5
        q, dout, blocks = _inputs(torch, case, seed=11)
        out, lse = _global_out_lse(torch, q, blocks, _calls(q.shape[1], case[5]), scale)
        ref_dq, ref_grads = _reference(torch, cfd, case, q, dout, blocks, out, lse, scale)
        dq_new, grads_new, sums = _run(torch, cfd, case, q, dout, blocks, out, lse, scale, True)
        dq_old, grads_old, _ = _run(torch, cfd, case, q, dout, blocks, out, lse, scale, False)
        assert sums.ws is not None and sums.plan is not None, "the workspace path did not run"
        ulp = 2.0 ** -7 * ref_dq.abs().max().item()
        e_new, e_old = _err(torch, dq_new, ref_dq), _err(torch, dq_old, ref_dq)
        print(f"\n{case}: dq error in workspace {e_new:.3e}, plain {e_old:.3e}; config "
              f"{sums.plan.config.name}")
        assert math.isfinite(e_new) and e_new <= 2 * e_old + ulp, (e_new, e_old)
        for i, ((dk_n, dv_n), (dk_o, dv_o), (dk_r, dv_r)) in enumerate(
                zip(grads_new, grads_old, ref_grads)):
            for name, a, b, r in (("dk", dk_n, dk_o, dk_r), ("dv", dv_n, dv_o, dv_r)):
                ea, eb = _err(torch, a, r), _err(torch, b, r)
                ulp = 2.0 ** -7 * r.abs().max().item()
                assert math.isfinite(ea) and ea <= 2 * eb + ulp, (i, name, ea, eb)
        if case[3] % 2 == 0:  # BWD_HEAD_GROUPS' head groups: strided views, the same bounds
            dq_g, grads_g, sums_g = _run_groups(torch, cfd, case, q, dout, blocks, out, lse,
                                                scale, 2)
            assert all(x.ws is not None for x in sums_g), "a head group left the workspace path"
            e_g = _err(torch, dq_g, ref_dq)
            print(f"{case}: dq error in 2 head groups {e_g:.3e}")
            assert math.isfinite(e_g) and e_g <= 2 * e_old + 2.0 ** -7 * ref_dq.abs().max().item()
            for i, ((dk_n, dv_n), (dk_o, dv_o), (dk_r, dv_r)) in enumerate(
                    zip(grads_g, grads_old, ref_grads)):
                for name, a, b, r in (("dk", dk_n, dk_o, dk_r), ("dv", dv_n, dv_o, dv_r)):
                    ea, eb = _err(torch, a, r), _err(torch, b, r)
                    assert math.isfinite(ea) and ea <= 2 * eb + 2.0 ** -7 * r.abs().max().item(), \
                        ("groups", i, name, ea, eb)
        if case[6]:  # deterministic: the same bits again
            dq_again, grads_again, _ = _run(torch, cfd, case, q, dout, blocks, out, lse, scale,
                                            True)
            assert torch.equal(dq_again, dq_new)
            for (a, b), (c, d) in zip(grads_again, grads_new):
                assert torch.equal(a, c) and torch.equal(b, d)
    finally:
        api.POISON_OUTPUTS = saved


@pytest.mark.parametrize("causal", [False, True])
def test_ring_of_one_process_uses_the_workspace(causal):
    """A ring of one process (NCCL, world 1: the rank's own block only) through autograd, with the
    dQ sums in the workspace: output and gradients as single-GPU flash_attn_func's (its error
    against the float64 reference bounds the ring's, 2x plus one ulp); deterministic twice:
    the same bits."""
    torch = _torch()
    import datetime
    import os
    import socket

    import torch.distributed as dist

    import cuflash
    from cuflash import distributed as cfd

    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"})
    made = not dist.is_initialized()
    if made:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0),
                                timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator(device="cuda").manual_seed(3)
        q, k, v, dout = (torch.randn(1, 512, 4, 128, device="cuda", dtype=torch.bfloat16,
                                     generator=g) for _ in range(4))
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        from cuflash import reference

        o_ref = torch.from_numpy(reference.attention_naive(
            *(x.detach().cpu().numpy() for x in ref), causal=causal)).cuda()
        grads_ref = [torch.from_numpy(x).cuda() for x in reference.attention_backward_naive(
            dout.double().cpu().numpy(), *(x.detach().cpu().numpy() for x in ref), causal=causal)]
        runs = []
        for fn in ("ring", "ring", "single"):
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            if fn == "ring":
                o = cfd.ring_flash_attn_func(*leaves, causal=causal, deterministic=True)
            else:
                o = cuflash.flash_attn_func(*leaves, causal=causal, deterministic=True)
            o.backward(dout)
            runs.append([o.detach()] + [x.grad for x in leaves])
        for a, b in zip(runs[0], runs[1]):
            assert torch.equal(a, b), "deterministic ring of one: two runs differ"
        for name, got, single, want in zip(("out", "dq", "dk", "dv"), runs[0], runs[2],
                                           [o_ref] + grads_ref):
            e_ring = (got.double() - want).abs().max().item()
            e_single = (single.double() - want).abs().max().item()
            ulp = 2.0 ** -7 * want.abs().max().item()
            print(f"ring of one, causal={causal}: {name} error {e_ring:.3e}, single GPU "
                  f"{e_single:.3e}")
            assert e_ring <= 2 * e_single + ulp, (name, e_ring, e_single)
    finally:
        if made:
            dist.destroy_process_group()
