"""ParallelMHA (fp32 parameters) under CUDA autocast bf16 on 2 GPUs, forward + backward, against one-GPU MHA
under the same autocast and against fp32 MHA; writes a JSON line per rank."""
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from cuflash.modules.mha import MHA, ParallelMHA, shard_mha_state_dict

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

def worker(rank, world, port, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = dist.new_group(list(range(world)))
    E, H, HK, B, S = 1024, 16, 4, 2, 512
    torch.manual_seed(0)
    full = MHA(E, H, num_heads_kv=HK, causal=True, use_flash_attn=True, rotary_emb_dim=32, device="cuda")
    ref = MHA(E, H, num_heads_kv=HK, causal=True, use_flash_attn=False, rotary_emb_dim=32, device="cuda")
    ref.load_state_dict(full.state_dict())
    res = {"rank": rank}
    for sp in (True, False):
        par = ParallelMHA(E, H, g, num_heads_kv=HK, causal=True, use_flash_attn=True, rotary_emb_dim=32,
                          sequence_parallel=sp, device="cuda")
        r = par.load_state_dict(shard_mha_state_dict(full.state_dict(), H, HK, world, rank), strict=False)
        res[f"load{int(sp)}"] = [list(r.missing_keys), list(r.unexpected_keys)]
        x = torch.randn(B * S, E, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        dout = torch.randn(B * S, E, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        rows = slice(rank * B * S // world, (rank + 1) * B * S // world) if sp else slice(None)
        xp = x[rows].clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yp = par(xp, seqlen=S)
        (yp.float() * dout[rows]).sum().backward()
        xf = x.clone().view(B, S, E).requires_grad_()
        y32 = ref(xf)
        (y32.reshape(B * S, E) * dout).sum().backward()
        g32 = xf.grad.reshape(B * S, E)[rows].clone()
        xb = x.clone().view(B, S, E).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yb = full(xb)
        full.zero_grad()
        (yb.float().reshape(B * S, E) * dout).sum().backward()
        res[f"sp{int(sp)}"] = dict(out_dtype=str(yp.dtype), wgrad_dtype=str(par.Wqkv.weight.grad.dtype),
                                   out_vs_fp32=rel(yp, y32.reshape(B * S, E)[rows].detach()),
                                   out_single_autocast_vs_fp32=rel(yb.reshape(B * S, E)[rows].detach(), y32.reshape(B * S, E)[rows].detach()),
                                   dx_vs_fp32=rel(xp.grad, g32),
                                   dx_single_autocast_vs_fp32=rel(xb.grad.reshape(B * S, E)[rows], g32),
                                   finite=bool(torch.isfinite(par.Wqkv.weight.grad).all()))
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)
    print(json.dumps(res), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29533, sys.argv[1]), nprocs=2)
