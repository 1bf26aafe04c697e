"""Timing of ParallelMHA against the single-GPU MHA (not a test): forward + backward of one
attention layer, bf16, use_flash_attn=True, in the same processes; one process per GPU over NCCL
(torch.multiprocessing.spawn), writes a JSON summary.

    python tests/parallel_mha_timing.py [--world N] [--json PATH] [--reps 20]

Shapes: (batch, seqlen, embed_dim, num_heads, num_heads_kv), causal, rotary 64 on half the head
dim. Per shape and rank: the median of --reps timed iterations (CUDA events around forward +
backward with a fixed dout, after 3 warm-up iterations) of (a) the single-GPU MHA on the whole
batch, (b) ParallelMHA with sequence_parallel (input and output this rank's rows), (c) without.
With world 1, (b) and (c) measure what the parallel linears' code path costs over nn.Linear;
with world P, the time of a tensor-parallel layer on P GPUs against one GPU doing the whole
layer (rank 0's MHA timing; every rank times its own).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHAPES = [(2, 4096, 2048, 16, 16), (4, 2048, 4096, 32, 8)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, reps):
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _worker(rank, world, port, reps, outdir):
    import torch
    import torch.distributed as dist

    from cuflash.modules.mha import MHA, ParallelMHA, shard_mha_state_dict

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    kw = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=180))
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank), **kw)
    except TypeError:
        dist.init_process_group("nccl", **kw)
    rows = []
    try:
        group = dist.new_group(list(range(world)))
        for batch, seqlen, embed, heads, heads_kv in SHAPES:
            d = embed // heads
            common = dict(num_heads_kv=heads_kv, causal=True, rotary_emb_dim=d // 2, use_flash_attn=True,
                          device="cuda", dtype=torch.bfloat16)
            torch.manual_seed(0)
            full = MHA(embed, heads, **common)
            x = torch.randn(batch, seqlen, embed, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn_like(x)

            def run(module, inp, grad, **fkw):
                out = module(inp, **fkw)
                out.backward(grad)

            row = dict(rank=rank, world=world, shape=[batch, seqlen, embed, heads, heads_kv],
                       mha_ms=_time(lambda: run(full, x, dout), reps))
            for sp in (True, False):
                par = ParallelMHA(embed, heads, group, sequence_parallel=sp, **common)
                par.load_state_dict(shard_mha_state_dict(full.state_dict(), heads, heads_kv, world, rank))
                if sp:
                    xin = x.detach().reshape(-1, embed).chunk(world)[rank].clone().requires_grad_()
                    g = dout.reshape(-1, embed).chunk(world)[rank].contiguous()
                    fkw = dict(seqlen=seqlen)
                else:
                    xin, g, fkw = x.detach().clone().requires_grad_(), dout, {}
                dist.barrier()
                row["parallel_sp_ms" if sp else "parallel_nosp_ms"] = _time(lambda: run(par, xin, g, **fkw), reps)
                del par
            print(json.dumps(row), flush=True)
            rows.append(row)
            del full, x, dout
            torch.cuda.empty_cache()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
        dist.destroy_process_group()


def main(argv=None) -> int:
    import torch
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    world = args.world or min(2, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(world, _free_port(), args.reps, outdir), nprocs=world, join=True)
        rows = []
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                rows += json.load(f)
    summary = dict(device=torch.cuda.get_device_name(0), world=world, torch=torch.__version__, reps=args.reps,
                   rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
