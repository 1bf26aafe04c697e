"""ParallelMHA on GPUs over NCCL (one process per GPU, torch.multiprocessing.spawn, no torchrun)
against the float64 single-process reference, the FlashAttention way; writes a JSON summary.

    python tests/parallel_mha_gpu_check.py [--world N] [--cases a,b] [--json PATH]

Every rank builds the same single-process MHA (use_flash_attn=True, the case's dtype, weights
and inputs from a seeded CPU generator) and its ParallelMHA loaded with its shard of that MHA's
state dict (shard_mha_state_dict). The reference is tests/mha_reference.py's plain attention on
the MHA's weights in float64, the baseline the same in the low precision (projections and
matmuls in bf16 / fp16, softmax in fp32). Tensor parallelism in low precision rounds more than
one process does: out_proj's partial products are rounded to the dtype on each rank before the
all-reduce / reduce-scatter sums them (as in flash-attn and Megatron), and so are the input
gradient's shares; so the baseline is also computed plainly with the same split (each rank's
heads, the partials rounded, then summed: plain_tp) and the rule takes the larger of the two
baselines' errors. ParallelMHA's output (this rank's rows with sequence_parallel) and the
gradients of its input and of every parameter shard must be within 2x (output) / 3x
(gradients) that error plus one ulp of the largest value, each on this rank's shard (the
reference's gradients in float64: a float64 copy of the module and of x); the single-GPU
cuflash MHA's error and both baselines' are recorded. Decoding: a prompt, then
single tokens through the KV cache (rotary 64: the fused flash_attn_with_kvcache path), each
step's rows under the same rule. cuflash's outputs are NaN-poisoned before each launch. NVLink
SHARP / multicast stay off (the device README).

--world defaults to min(2, GPUs); world 1 runs the same checks with one rank (the parallel
linears skip their collectives there; --collectives runs them over the one-rank NCCL group).
--cpu: a dry run of this script without GPUs (gloo, CPU tensors: cuflash's float64 reference
path, so the errors say nothing about the kernels). Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import socket
import sys
import tempfile
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# name: (embed_dim, num_heads, kwargs, input: "flat" ((batch · seqlen, E), seqlen=) or "3d", batch, seqlen, dtype)
CASES = {
    "mha_sp_causal_rotary_d64": (1024, 16, dict(causal=True, rotary_emb_dim=32, sequence_parallel=True), "flat",
                                 2, 257, "bf16"),
    "gqa_nosp_causal_rotary_d128": (1024, 8, dict(num_heads_kv=2, causal=True, rotary_emb_dim=64,
                                                  sequence_parallel=False), "3d", 2, 300, "bf16"),
    "gqa_sp_alibi_window_d64": (512, 8, dict(num_heads_kv=4, causal=True, use_alibi=True, window_size=(64, 0),
                                             sequence_parallel=True), "3d", 2, 333, "bf16"),
    "mha_nosp_noncausal_fp16_d64": (512, 8, dict(sequence_parallel=False, qkv_proj_bias=False), "flat", 2, 130,
                                    "fp16"),
}
# decoding: (embed_dim, num_heads, kwargs, batch, prompt, steps, dtype)
DECODE_CASES = {
    "decode_gqa_rotary64_nosp": (1024, 8, dict(num_heads_kv=2, rotary_emb_dim=64, sequence_parallel=False), 2, 100,
                                 3, "bf16"),
    "decode_mha_sp": (512, 8, dict(sequence_parallel=True), 2, 64, 2, "bf16"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ulp(value, dtype):
    import torch

    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(value, 2.0 ** -14)))


class _Checks:
    """The rule, and a record of every comparison."""

    def __init__(self, rank, world):
        self.rank, self.world, self.rows = rank, world, []

    def rule(self, case, what, got, ref, base, base_tp, single, factor, dtype):
        def err_of(t):
            return (t.double() - ref).abs().max().item() if t.numel() else 0.0

        top = ref.abs().max().item() if ref.numel() else 0.0
        floor = max(_ulp(top, dtype), 1e-5 * max(1.0, top))
        err, base_err, tp_err = err_of(got), err_of(base), err_of(base_tp)
        single_err = None if single is None else err_of(single)
        ok = bool(not got.isnan().any()) and err <= factor * max(base_err, tp_err) + floor
        self.rows.append(dict(case=case, rank=self.rank, world=self.world, what=what, err=err, plain_err=base_err,
                              plain_tp_err=tp_err, single_gpu_err=single_err, factor=factor, floor=floor, ok=ok))
        print(f"rank {self.rank}/{self.world} {case} {what}: parallel err {err:.3g}, single-GPU cuflash "
              f"{'-' if single_err is None else f'{single_err:.3g}'}, plain {base_err:.3g}, plain_tp {tp_err:.3g} "
              f"-> {'ok' if ok else 'FAIL'}", flush=True)


DEVICE = "cuda"   # "cpu" with --cpu (set in each worker)


def _modules(embed_dim, num_heads, kw, dtype, world, rank, group, seed, **extra):
    """The single-process MHA (same weights on every rank) and this rank's ParallelMHA."""
    import torch

    from cuflash.modules.mha import MHA, ParallelMHA, shard_mha_state_dict

    common = {k: v for k, v in kw.items() if k != "sequence_parallel"}
    full = MHA(embed_dim, num_heads, use_flash_attn=True, device=DEVICE, dtype=dtype, **common, **extra)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(full.named_parameters()):
            fan_in = p.shape[-1] if p.dim() > 1 else embed_dim
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in))
    par = ParallelMHA(embed_dim, num_heads, group, use_flash_attn=True, device=DEVICE, dtype=dtype, **kw, **extra)
    par.load_state_dict(shard_mha_state_dict(full.state_dict(), num_heads, kw.get("num_heads_kv", num_heads),
                                             world, rank))
    return full, par


def _reference_tp(m, x, world, dtype, alibi=False, window=(-1, -1)):
    """The module m's forward computed plainly in dtype (tests/mha_reference.py's steps) with
    ParallelMHA's split over world ranks: each rank's Wqkv rows and heads on their own, out_proj
    as the ranks' partial products (rounded to dtype) summed in rank order, so that autograd also
    sums the input gradient's per-rank shares in dtype. Differentiable in x and m's weights."""
    import torch
    import torch.nn.functional as F

    from cuflash.modules.mha import _rank_rows, get_alibi_slopes
    from cuflash.utils.distributed import local_range
    from mha_reference import attention, rotary_angles, rotate

    P = {name: t.to(dtype) for name, t in m.named_parameters()}
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    group = h // hk
    x = x.to(dtype)
    slopes = get_alibi_slopes(h) if alibi else None
    scale = m.inner_attn.softmax_scale or 1 / math.sqrt(d)
    out = None
    for r in range(world):
        rows, cols = _rank_rows(h, hk, d, world, r)
        rows = rows.to(x.device)
        a, b = local_range(hk, world, r)
        hq, hkv = group * (b - a), b - a
        qkv = F.linear(x, P["Wqkv.weight"][rows], P["Wqkv.bias"][rows] if "Wqkv.bias" in P else None)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        if m.rotary_emb_dim:
            angles = rotary_angles(q.shape[1], m.rotary_emb_dim, m.rotary_emb.base, x.device)
            q, k = rotate(q, angles, m.rotary_emb.interleaved), rotate(k, angles, m.rotary_emb.interleaved)
        ctx = attention(q, k, v, scale, m.causal, None, window, None if slopes is None else slopes[group * a:group * b],
                        low=True, queries_padded=True)
        bias = P.get("out_proj.bias") if r == 0 else None
        part = F.linear(ctx.flatten(-2), P["out_proj.weight"][:, cols], bias)
        out = part if out is None else out + part
    return out


def _check_case(checks, rank, world, group, name, case, seed):
    import torch

    from cuflash.modules.mha import shard_mha_state_dict
    from mha_reference import reference_mha

    embed_dim, num_heads, kw, mode, batch, seqlen, dt = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    sp = kw["sequence_parallel"]
    full, par = _modules(embed_dim, num_heads, kw, dtype, world, rank, group, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seqlen, embed_dim, generator=g).to(DEVICE, dtype).requires_grad_()
    dout = torch.randn(batch, seqlen, embed_dim, generator=g).to(DEVICE, dtype)
    ref_kw = {"window": kw["window_size"], "alibi": True} if kw.get("use_alibi") else {}
    names = [n for n, _ in full.named_parameters()]
    params = [x] + [p for _, p in full.named_parameters()]
    # the reference's gradients in float64: a float64 copy of the module and of x as leaves (the
    # gradients with respect to the 16-bit tensors themselves would be rounded to 16 bits)
    full64 = copy.deepcopy(full).to(torch.float64)
    x64 = x.detach().double().requires_grad_()
    ref = reference_mha(full64, x64, dtype=torch.float64, **ref_kw)
    base = reference_mha(full, x, dtype=dtype, **ref_kw)
    base_tp = _reference_tp(full, x, world, dtype, **ref_kw)
    single = full(x)
    ref_g = torch.autograd.grad(ref, [x64] + [p for _, p in full64.named_parameters()], dout.double())
    base_g = torch.autograd.grad(base, params, dout)
    tp_g = torch.autograd.grad(base_tp, params, dout)
    single_g = torch.autograd.grad(single, params, dout)

    def local(t):
        if mode == "flat":
            t = t.reshape(-1, t.shape[-1])
        return t.chunk(world, dim=0)[rank] if sp else t

    xin = local(x.detach()).clone().requires_grad_()
    out = par(xin, seqlen=seqlen if mode == "flat" else None)
    pparams = dict(par.named_parameters())
    got_g = torch.autograd.grad(out, [xin, *pparams.values()], local(dout))
    _sync()
    checks.rule(name, "out", out, local(ref), local(base), local(base_tp), local(single), 2, dtype)
    checks.rule(name, "dx", got_g[0], local(ref_g[0]), local(base_g[0]), local(tp_g[0]), local(single_g[0]), 3, dtype)
    hkv = kw.get("num_heads_kv", num_heads)
    shard = lambda grads: shard_mha_state_dict(dict(zip(names, grads)), num_heads, hkv, world, rank)  # noqa: E731
    r, b, t, s = shard(ref_g[1:]), shard(base_g[1:]), shard(tp_g[1:]), shard(single_g[1:])
    for key, grad in zip(pparams, got_g[1:]):
        checks.rule(name, f"d{key}", grad, r[key], b[key], t[key], s[key], 3, dtype)


def _check_decode(checks, rank, world, group, name, case, seed):
    import torch

    from cuflash.utils.generation import InferenceParams
    from mha_reference import reference_mha

    embed_dim, num_heads, kw, batch, prompt, steps, dt = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    sp = kw["sequence_parallel"]
    full, par = _modules(embed_dim, num_heads, dict(kw, causal=True), dtype, world, rank, group, seed, layer_idx=0)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, prompt + steps, embed_dim, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        ref = reference_mha(full, x, dtype=torch.float64)
        base = reference_mha(full, x, dtype=dtype)
        base_tp = _reference_tp(full, x, world, dtype)
        pf = InferenceParams(max_seqlen=prompt + steps + 5, max_batch_size=batch)
        pp = InferenceParams(max_seqlen=prompt + steps + 5, max_batch_size=batch)

        def local(t):
            return t.reshape(-1, embed_dim).chunk(world, dim=0)[rank] if sp else t

        def step(lo, hi):
            chunk = x[:, lo:hi]
            single = full(chunk, inference_params=pf)
            out = (par(local(chunk), seqlen=hi - lo, inference_params=pp) if sp
                   else par(chunk, inference_params=pp))
            _sync()
            checks.rule(name, f"out[{lo}:{hi}]", out, local(ref[:, lo:hi]), local(base[:, lo:hi]),
                        local(base_tp[:, lo:hi]), local(single), 2, dtype)

        step(0, prompt)
        for t in range(prompt, prompt + steps):
            pf.seqlen_offset = pp.seqlen_offset = t
            step(t, t + 1)


def _sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _worker(rank, world, port, names, outdir, cpu=False, collectives=False):
    import torch
    import torch.distributed as dist

    from cuflash import api
    from cuflash.ops import fused_dense

    if collectives:
        fused_dense.ONE_RANK_SHORTCUT = False

    global DEVICE
    kw = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=180))
    if cpu:
        DEVICE = "cpu"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", **kw)
    else:
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank)
        api.POISON_OUTPUTS = True
        try:
            dist.init_process_group("nccl", device_id=torch.device("cuda", rank), **kw)
        except TypeError:   # an older torch: no device_id
            dist.init_process_group("nccl", **kw)
    checks = _Checks(rank, world)
    errors = []
    try:
        group = dist.new_group(list(range(world)))
        for i, name in enumerate(names):
            try:
                if name in CASES:
                    _check_case(checks, rank, world, group, name, CASES[name], seed=10 + i)
                else:
                    _check_decode(checks, rank, world, group, name, DECODE_CASES[name], seed=10 + i)
            except Exception as e:  # noqa: BLE001  (recorded; the other ranks may hang: the timeout ends them)
                errors.append(f"rank {rank} {name}: {type(e).__name__}: {e}")
                print(errors[-1], flush=True)
                raise
        dist.barrier()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(dict(rows=checks.rows, errors=errors), f)
        dist.destroy_process_group()


def run(world=None, names=None, json_path=None, cpu=False, collectives=False) -> dict:
    """Spawn the ranks, run the cases, merge their records: the summary dict (ok, failures, rows)."""
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count()
    world = world or min(2, gpus)
    if world < 1 or (world > gpus and not cpu):
        raise ValueError(f"--world {world}: this machine has {gpus} GPU(s)")
    names = names or sorted(CASES) + sorted(DECODE_CASES)
    unknown = [n for n in names if n not in CASES and n not in DECODE_CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {sorted(CASES) + sorted(DECODE_CASES)}")
    start = time.time()
    spawn_error = None
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.spawn(_worker, args=(world, _free_port(), names, outdir, cpu, collectives), nprocs=world, join=True)
        except Exception as e:  # noqa: BLE001
            spawn_error = f"{type(e).__name__}: {str(e)[-2000:]}"
        rows, errors = [], []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    part = json.load(f)
                rows += part["rows"]
                errors += part["errors"]
            else:
                errors.append(f"rank {r}: no record")
    if spawn_error:
        errors.append(spawn_error)
    failures = [r for r in rows if not r["ok"]]
    device = "cpu (dry run)" if cpu else torch.cuda.get_device_name(0)
    summary = dict(device=device, gpus=gpus, world=world, one_rank_collectives=collectives, torch=torch.__version__,
                   cases=names, checks=len(rows), failures=failures, errors=errors,
                   ok=bool(rows) and not failures and not errors, wall_s=round(time.time() - start, 1), rows=rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (GPUs); default min(2, GPUs)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU tensors over gloo (no kernels)")
    ap.add_argument("--collectives", action="store_true",
                    help="world 1: run the parallel linears' collectives over the one-rank group anyway")
    args = ap.parse_args(argv)
    summary = run(args.world, args.cases.split(",") if args.cases else None, args.json, args.cpu, args.collectives)
    print(f"world {summary['world']} on {summary['device']}: {summary['checks']} checks, "
          f"{len(summary['failures'])} failed, {len(summary['errors'])} errors, {summary['wall_s']} s -> "
          f"{'OK' if summary['ok'] else 'FAIL'}", flush=True)
    for e in summary["errors"]:
        print("error:", e, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
