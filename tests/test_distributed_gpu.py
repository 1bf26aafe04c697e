"""cuflash.distributed on GPUs: ring attention over NCCL, one process per GPU (P = 2, and
P = 3 and 4 where there are that many), against single-GPU cuflash and the float64 reference.

Each process runs every case on the full sequence's inputs (same seed on every rank): the
float64 reference and plain low-precision attention (torch ops on its GPU), single-GPU
cuflash (flash_attn_func with autograd), and the ring on its shard. The ring's output and
gradients (q, k, v) must be within 2x (3x for gradients) the error of plain attention in the
same low precision (plus one ulp of the largest value), like every kernel test, and the
single-GPU cuflash error is printed next to it. cuflash's outputs are NaN-poisoned before each
launch. NVLink SHARP / multicast stay off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1) as the device README requires.

Varlen (ring_flash_attn_varlen_func): packed batches with empty, short and odd-chunked
sequences, against single-GPU flash_attn_varlen_func and the float64 reference per sequence,
under the same rule.

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -s tests/test_distributed_gpu.py
"""
from __future__ import annotations

import datetime
import math
import os
import socket

import pytest

pytestmark = pytest.mark.gpu

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

# (batch, chunk length, nheads, nheads_kv, headdim, causal, layout, dtype); the sequence is
# 2P chunks (zigzag) or P chunks (contiguous)
CASES = [
    (2, 256, 8, 8, 128, True, "zigzag", "bf16"),
    (1, 113, 4, 1, 64, True, "zigzag", "fp16"),       # MQA, odd chunks
    (1, 17, 6, 2, 128, False, "zigzag", "bf16"),      # GQA, non-causal
    (1, 300, 4, 2, 128, True, "contiguous", "bf16"),
    (1, 1, 2, 2, 64, True, "zigzag", "bf16"),         # one position per chunk
]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(q, k, v, causal, scale, dtype):
    """Plain attention in torch ops, in `dtype` (float64: the reference), differentiable."""
    import torch

    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = (q @ k.transpose(-1, -2)).to(acc) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, -1)
    return (p.to(dtype) @ v).transpose(1, 2)


def _init_rank(rank, world, port) -> None:
    """This process's GPU and its NCCL group (multicast off), outputs poisoned before each
    launch. A rank that fails leaves the others in a collective: they time out (180 s)
    instead of hanging."""
    import torch
    import torch.distributed as dist

    from cuflash import api

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    api.POISON_OUTPUTS = True
    kw = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=180))
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank), **kw)
    except TypeError:  # an older torch: no device_id
        dist.init_process_group("nccl", **kw)


def _compare(what, shard, ref, low, single, ring, dtype, dt) -> list:
    """The ring's out, dq, dk, dv against the float64 reference on this rank's shard, within 2x
    (3x for gradients) plain low-precision attention's error plus one ulp of the largest
    value; prints a line each (single-GPU cuflash's error beside it), returns the failures."""
    failures = []
    for j, name in enumerate(("out", "dq", "dk", "dv")):
        r, lo, one, got = shard(ref[j]), shard(low[j]), shard(single[j]), ring[j]
        top = r.abs().max().item()
        floor = max(_ulp(top, dtype), 1e-5 * max(1.0, top))
        err = (got.double() - r).abs().max().item()
        base = (lo.double() - r).abs().max().item()
        err_single = (one.double() - r).abs().max().item()
        factor = 2 if name == "out" else 3
        ok = bool(not got.isnan().any()) and err <= factor * base + floor
        line = (f"{what} {name}: ring err {err:.3g}, single-GPU cuflash {err_single:.3g}, "
                f"plain {dt} {base:.3g} -> {'ok' if ok else 'FAIL'}")
        print(line, flush=True)
        if not ok:
            failures.append(line)
    return failures


def _grads(fn, q, k, v, dout):
    import torch

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _ulp(value, dtype):
    import torch

    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(value, 2.0 ** -14)))


def _worker(rank, world, port, cases, errors):
    import torch.distributed as dist

    _init_rank(rank, world, port)
    try:
        failures = _dense_checks(rank, world, None, cases)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures))


def _dense_checks(rank, world, group, cases, first_extra=True, tag="") -> list:
    """Every dense case on this rank's shard of a ring of ``world`` ranks over ``group`` (None:
    the default group); the failures' lines. first_extra: case 0 also deterministic twice and
    with strided K/V (traced, REVERSE_BWD flipped)."""
    import torch

    import cuflash
    from cuflash import distributed as cfd

    failures = []
    for i, (b, n, h, hk, d, causal, layout, dt) in enumerate(cases):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        s = n * (2 * world if layout == "zigzag" else world)
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        q, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
                   for _ in range(2))
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=g)
                for _ in range(2))
        scale = 1 / math.sqrt(d)
        ref = _grads(lambda q, k, v: _plain(q, k, v, causal, scale, torch.float64),
                     q, k, v, dout.double())
        low = _grads(lambda q, k, v: _plain(q, k, v, causal, scale, dtype), q, k, v, dout)
        single = _grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal),
                        q, k, v, dout)
        shard = (lambda x: cfd.zigzag_shard(x, rank, world)) if layout == "zigzag" else \
            (lambda x: cfd.contiguous_shard(x, rank, world))
        ring = _grads(lambda q, k, v: cfd.ring_flash_attn_func(q, k, v, causal=causal,
                                                              layout=layout, group=group),
                      shard(q), shard(k), shard(v), shard(dout))
        torch.cuda.synchronize()
        what = f"rank {rank}/{world}{tag} case {i} {(b, s, h, hk, d, causal, layout, dt)}"
        failures += _compare(what, shard, ref, low, single, ring, dtype, dt)
        if i == 0 and first_extra:
            failures += _deterministic_and_strided(what, cfd, shard, q, k, v, dout, causal,
                                                   layout, ref, low, single, dtype, dt, group,
                                                   world)
        del ref, low, single, ring
    return failures


def _deterministic_and_strided(what, cfd, shard, q, k, v, dout, causal, layout, ref, low, single,
                               dtype, dt, group=None, world=None) -> list:
    """deterministic=True twice: bitwise equal outputs and gradients, within the error rule;
    and K/V as strided views (unbind of a packed kv tensor, as flash_attn_kvpacked_func users
    pass them): the ring sends them contiguous, same results as contiguous K/V."""
    import torch

    failures = []
    det = [_grads(lambda q, k, v: cfd.ring_flash_attn_func(q, k, v, causal=causal, layout=layout,
                                                           deterministic=True, group=group),
                  shard(q), shard(k), shard(v), shard(dout)) for _ in range(2)]
    torch.cuda.synchronize()
    failures += _compare(what + " deterministic", shard, ref, low, single, det[0], dtype, dt)
    same = all(torch.equal(a, b) for a, b in zip(det[0], det[1]))
    print(f"{what} deterministic: two runs bitwise equal: {same}", flush=True)
    if not same:
        failures.append(f"{what} deterministic: two runs differ")
    ql = shard(q).detach().clone().requires_grad_()
    kv = torch.stack((shard(k), shard(v)), dim=2).requires_grad_()  # (b, s, 2, hk, d)
    ks, vs = kv.unbind(2)                                            # strided views
    assert not ks.is_contiguous()
    # this run traced too (bench --ring-breakdown), and with the backward the other way
    # round (REVERSE_BWD flipped): the same results
    cfd.TRACE, cfd.REVERSE_BWD = [], not cfd.REVERSE_BWD
    try:
        out = cfd.ring_flash_attn_func(ql, ks, vs, causal=causal, layout=layout, group=group)
        dq, dkv = torch.autograd.grad(out, (ql, kv), shard(dout))
    finally:
        trace, cfd.TRACE, cfd.REVERSE_BWD = cfd.TRACE, None, not cfd.REVERSE_BWD
    strided = (out.detach(), dq, *dkv.unbind(2))
    torch.cuda.synchronize()
    failures += _compare(what + f" strided kv, REVERSE_BWD {not cfd.REVERSE_BWD}", shard, ref,
                         low, single, strided, dtype, dt)
    times = cfd.trace_summary(trace)
    world = world or torch.distributed.get_world_size()
    want = {"fwd_compute", "fwd_merge", "fwd_final", "bwd_compute", "bwd_accum", "bwd_final"}
    if world > 1:
        want |= {"fwd_wait", "bwd_wait"}
    ok = want <= set(times) and len(times["fwd_compute"]) == world and all(
        t >= 0 and math.isfinite(t) for steps in times.values() for t in steps)
    print(f"{what} trace: {({k: [round(t, 3) for t in v] for k, v in times.items()})} -> "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    if not ok:
        failures.append(f"{what} trace: phases {sorted(times)}, expected {sorted(want)}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_single_gpu(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)  # the children inherit them (set before NCCL starts)
    mp.spawn(_worker, args=(world, _free_port(), CASES, None), nprocs=world, join=True)


# varlen: (sequence lengths in chunks, nheads, nheads_kv, headdim, causal, layout, dtype); a
# sequence of u chunks is u * 2P (zigzag) or u * P (contiguous) tokens long
VARLEN_CASES = [
    ((0, 1, 3, 113, 64), 8, 2, 128, True, "zigzag", "bf16"),    # GQA, empty and 1-token chunks
    ((5, 17, 0, 40), 4, 1, 128, False, "zigzag", "bf16"),       # MQA, non-causal
    ((3, 100, 1), 4, 4, 128, True, "contiguous", "bf16"),
]


def _plain_varlen(q, k, v, cu, causal, scale, dtype):
    """_plain per sequence of a packed batch (empty sequences: no rows)."""
    import torch

    bounds = cu.tolist()
    outs = [_plain(q[None, a:b], k[None, a:b], v[None, a:b], causal, scale, dtype)[0] if b > a
            else q[a:b].to(dtype) * 0 for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs)


def _varlen_worker(rank, world, port, cases):
    import torch.distributed as dist

    _init_rank(rank, world, port)
    try:
        failures = _varlen_checks(rank, world, None, cases)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures))


def _varlen_checks(rank, world, group, cases, tag="") -> list:
    """Every varlen case on this rank's shard of a ring of ``world`` ranks over ``group``."""
    import numpy as np
    import torch

    import cuflash
    from cuflash import distributed as cfd

    failures = []
    for i, (units, h, hk, d, causal, layout, dt) in enumerate(cases):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        lens = [u * cfd.chunk_count(world, layout) for u in units]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32,
                          device="cuda")
        total, longest = int(sum(lens)), max(lens)
        g = torch.Generator(device="cuda").manual_seed(200 + i)
        q, dout = (torch.randn(total, h, d, device="cuda", dtype=dtype, generator=g)
                   for _ in range(2))
        k, v = (torch.randn(total, hk, d, device="cuda", dtype=dtype, generator=g)
                for _ in range(2))
        scale = 1 / math.sqrt(d)
        ref = _grads(lambda q, k, v: _plain_varlen(q, k, v, cu, causal, scale, torch.float64),
                     q, k, v, dout.double())
        low = _grads(lambda q, k, v: _plain_varlen(q, k, v, cu, causal, scale, dtype),
                     q, k, v, dout)
        single = _grads(lambda q, k, v: cuflash.flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=causal), q, k, v, dout)
        shard = lambda x: cfd.varlen_shard(x, cu, rank, world, layout)[0]  # noqa: E731
        ring = _grads(lambda q, k, v: cfd.ring_flash_attn_varlen_func(
            q, k, v, cu, longest, causal=causal, layout=layout, group=group),
            shard(q), shard(k), shard(v), shard(dout))
        torch.cuda.synchronize()
        failures += _compare(f"rank {rank}/{world}{tag} varlen case {i} lens {lens} "
                             f"{(h, hk, d, causal, layout, dt)}", shard, ref, low, single, ring,
                             dtype, dt)
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])  # 1: the per-chunk varlen calls alone, no ring
def test_ring_varlen_matches_single_gpu(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    mp.spawn(_varlen_worker, args=(world, _free_port(), VARLEN_CASES), nprocs=world, join=True)


# the straggler fixes' code paths at full size: FWD_DYNAMIC needs a call on the static persistent
# schedule (non-causal, >= 2k keys: 2048 positions per rank), PRIORITY_GROUP the default group;
# FWD_GRID_STEPS = 1 runs the first case's step 0 on a grid of one CTA per tile (its later steps
# static persistent, FWD_DYNAMIC being off there)
FLAG_CASES = [(1, 1024, 2, 1, 128, False, "zigzag", "bf16"),
              (1, 1024, 2, 2, 128, True, "zigzag", "bf16")]


def _sizes_worker(rank, world, port):
    """P = world, world - 1, ..., 2 in one set of processes (the smaller rings on subgroups of
    the first P ranks, which also checks the ring's group argument), dense and varlen cases
    (at P = world FLAG_CASES too: the defaults' FWD_DYNAMIC switch at full size, from P = 2 up:
    FWD_DYNAMIC_MIN_WORLD lowered to 2 for these passes); the varlen calls alone on rank 0
    (P = 1); and at P = world the cases again with FWD_DYNAMIC and PRIORITY_GROUP flipped,
    FWD_GRID_STEPS = 1 and the backward's other two paths (DKV_HOME's shares home during the next
    step; the fp32 accumulator travelling with the block), with DQ_IN_WORKSPACE and HOME_LAZY_FP32
    flipped; then the backward on all heads at once (BWD_HEAD_GROUPS = 1; the passes before ran it
    per group of heads where nheads_kv allows), and the forward per group of heads
    (FWD_HEAD_GROUPS = 4)."""
    import torch.distributed as dist

    from cuflash import distributed as cfd

    _init_rank(rank, world, port)
    failures = []
    min_world, cfd.FWD_DYNAMIC_MIN_WORLD = cfd.FWD_DYNAMIC_MIN_WORLD, 2
    try:
        for P in range(world, 1, -1):
            group = None if P == world else dist.new_group(list(range(P)))  # every rank makes it
            if rank < P:
                failures += _dense_checks(rank, P, group, CASES + (FLAG_CASES if P == world else []),
                                          first_extra=P == world)
                failures += _varlen_checks(rank, P, group, VARLEN_CASES)
            dist.barrier()
        one = dist.new_group([0])
        if rank == 0:
            failures += _varlen_checks(0, 1, one, VARLEN_CASES)
        dist.barrier()
        saved = cfd.FWD_DYNAMIC, cfd.PRIORITY_GROUP, cfd.FWD_GRID_STEPS, cfd.DKV_HOME, \
            cfd.BWD_LOW_MEMORY, cfd.DQ_IN_WORKSPACE, cfd.HOME_LAZY_FP32
        # (the backward's shares home during the next step: DKV_HOME, BWD_LOW_MEMORY off; dQ
        # summed apart from the kernels' workspace; the home sums in fp32 from the first share)
        cfd.FWD_DYNAMIC, cfd.PRIORITY_GROUP, cfd.FWD_GRID_STEPS, cfd.DKV_HOME, cfd.BWD_LOW_MEMORY, \
            cfd.DQ_IN_WORKSPACE, cfd.HOME_LAZY_FP32 = \
            not saved[0], not saved[1], 1, True, False, not saved[5], not saved[6]
        try:
            tag = (f" FWD_DYNAMIC={cfd.FWD_DYNAMIC} PRIORITY_GROUP={cfd.PRIORITY_GROUP} "
                   f"FWD_GRID_STEPS={cfd.FWD_GRID_STEPS} DKV_HOME={cfd.DKV_HOME} "
                   f"BWD_LOW_MEMORY={cfd.BWD_LOW_MEMORY} DQ_IN_WORKSPACE={cfd.DQ_IN_WORKSPACE} "
                   f"HOME_LAZY_FP32={cfd.HOME_LAZY_FP32}")
            failures += _dense_checks(rank, world, None, FLAG_CASES + CASES[:1], first_extra=False,
                                      tag=tag)
            failures += _varlen_checks(rank, world, None, VARLEN_CASES[:1], tag=tag)
            cfd.DKV_HOME = False  # (an fp32 accumulator travelling with the block)
            failures += _dense_checks(rank, world, None, CASES[:2], first_extra=False,
                                      tag=tag.replace("DKV_HOME=True", "DKV_HOME=False"))
            grid = [c.name for key, c in cfd._dynamic_configs.items() if key[-1] and c is not None]
            print(f"rank {rank}/{world}{tag}: grid configs run {grid}", flush=True)
            if not grid or any("persist" in name for name in grid):
                failures.append(f"rank {rank}: FWD_GRID_STEPS=1 ran no non-causal call on a grid "
                                f"of one CTA per tile (configs {grid})")
        finally:
            cfd.FWD_DYNAMIC, cfd.PRIORITY_GROUP, cfd.FWD_GRID_STEPS, cfd.DKV_HOME, \
                cfd.BWD_LOW_MEMORY, cfd.DQ_IN_WORKSPACE, cfd.HOME_LAZY_FP32 = saved
        dist.barrier()
        saved = cfd.BWD_HEAD_GROUPS, cfd.FWD_HEAD_GROUPS
        try:  # (the backward on all heads at once, as before BWD_HEAD_GROUPS; the forward per
            # group of heads, FWD_HEAD_GROUPS)
            cfd.BWD_HEAD_GROUPS = 1
            failures += _dense_checks(rank, world, None, CASES[:1] + CASES[2:3] + FLAG_CASES[1:],
                                      first_extra=False, tag=" BWD_HEAD_GROUPS=1")
            cfd.BWD_HEAD_GROUPS, cfd.FWD_HEAD_GROUPS = saved[0], 4
            failures += _dense_checks(rank, world, None, CASES[:1] + FLAG_CASES[1:],
                                      first_extra=False, tag=" FWD_HEAD_GROUPS=4")
        finally:
            cfd.BWD_HEAD_GROUPS, cfd.FWD_HEAD_GROUPS = saved
        dist.barrier()
    finally:
        cfd.FWD_DYNAMIC_MIN_WORLD = min_world
        dist.destroy_process_group()
    if failures:
        raise AssertionError("\n".join(failures))


def test_ring_every_size_one_spawn():
    """P = 2 .. min(4, GPUs) and the varlen ring in one spawn (the fast form of the tests
    above, for a short GPU call)."""
    world = min(4, _gpus())
    if world < 2:
        pytest.skip(f"needs 2 GPUs, found {_gpus()}")
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    mp.spawn(_sizes_worker, args=(world, _free_port()), nprocs=world, join=True)
