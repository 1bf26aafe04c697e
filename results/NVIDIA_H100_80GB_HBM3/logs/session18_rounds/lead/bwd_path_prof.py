"""Session 18, lead: kernels (torch.profiler, CUDA time per kernel name) of one sm90_bwd backward on
the CuPy path vs the torch path (bf16 d64 non-causal 2k, the dynamic heuristic; d128 causal 2k),
5 calls each after warm-up. Round 2 found the CuPy path 17-27% slower with the dynamic scheduler."""
import os, sys, json, collections
sys.path.insert(0, os.getcwd())
import cupy, torch
import cuflash
from torch.profiler import profile, ProfilerActivity

rows = []
for d, causal, s in ((64, False, 2048), (128, True, 2048)):
    b, h = 16384 // s, 2048 // d
    tq, tk, tv, tdo = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tout, tlse, _ = cuflash.flash_attn_func(tq, tk, tv, causal=causal, return_attn_probs=True)
    cq, ck, cv, cdo, cout, clse = (cupy.from_dlpack(x) for x in (tq, tk, tv, tdo, tout, tlse))
    bw = cuflash.flash_attn_backward
    print("cupy stream", cupy.cuda.get_current_stream().ptr, "torch stream", torch.cuda.current_stream().cuda_stream)
    for name, fn in (("cupy", lambda: bw(cdo, cq, ck, cv, cout, clse, causal=causal)),
                     ("torch", lambda: bw(tdo, tq, tk, tv, tout, tlse, causal=causal))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(); cupy.cuda.Device().synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                r = fn()
            torch.cuda.synchronize(); cupy.cuda.Device().synchronize()
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name[:90]][0] += 1; agg[e.name[:90]][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        row = dict(d=d, causal=causal, path=name, kernels={k: v for k, v in agg.items()})
        rows.append(row)
        print(name, d, causal)
        for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"   {n:3d} x {us / max(n, 1):9.1f} us  {k}")
json.dump(rows, open("/tmp/lead_bwd_prof.json", "w"), indent=1)
