"""Per-kernel GPU time of one backward (torch.profiler / CUPTI), cuflash vs SDPA cuDNN and flash,
bf16, dim 2048 (heads = 2048/d), batch*seqlen 16k. Prints one JSON line per (impl, shape)."""
import json, sys, torch, cuflash
from torch.profiler import profile, ProfilerActivity
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
out = []
def prof(fn, reps=5):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    k = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k.setdefault(e.name, []).append(e.device_time if hasattr(e, 'device_time') else e.cuda_time)
    return {n[:90]: round(sum(v) / reps, 1) for n, v in k.items()}
for d in (128, 64):
    for s in (2048, 16384):
        for causal in (False, True):
            h, b = 2048 // d, 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            o = cuflash.flash_attn_func(q, k, v, causal=causal)
            r = prof(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            out.append({"impl": "cuflash", "d": d, "s": s, "causal": causal, "us": r, "total": round(sum(r.values()), 1)})
            qt, kt, vt, dot = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v, do))
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(be):
                    ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    r = prof(lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True))
                out.append({"impl": name, "d": d, "s": s, "causal": causal, "us": r, "total": round(sum(r.values()), 1)})
            for x in out[-3:]: print(json.dumps(x), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
