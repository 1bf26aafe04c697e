"""Where one eager forward+backward's wall time goes (cuflash vs SDPA cuDNN): host timestamps
of each stage and a torch.profiler trace of the CUDA API calls."""
import json, os, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import cuflash

out = sys.argv[1] if len(sys.argv) > 1 else '/tmp'
b, s, h, d = 8, 2048, 16, 128
def mk(shape):
    return torch.randn(shape, device='cuda', dtype=torch.bfloat16, requires_grad=True)
q, k, v = (mk((b, s, h, d)) for _ in range(3))
qt, kt, vt = (mk((b, h, s, d)) for _ in range(3))
def cf():
    o = cuflash.flash_attn_func(q, k, v, causal=True); return o
def cd():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
res = {}
for name, f in (('cuflash', cf), ('sdpa_cudnn', cd)):
    for _ in range(5):
        f().sum().backward()
    torch.cuda.synchronize()
    st = []
    for _ in range(20):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        o = f(); t1 = time.perf_counter()
        l = o.sum(); t2 = time.perf_counter()
        l.backward(); t3 = time.perf_counter()
        torch.cuda.synchronize(); t4 = time.perf_counter()
        st.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0])
    st.sort(key=lambda x: x[-1])
    m = st[len(st) // 2]
    res[name] = dict(fwd_host_us=m[0] * 1e6, sum_us=m[1] * 1e6, bwd_host_us=m[2] * 1e6, sync_wait_us=m[3] * 1e6, wall_us=m[4] * 1e6)
    print(name, {k2: round(v2, 1) for k2, v2 in res[name].items()}, flush=True)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            f().sum().backward()
        torch.cuda.synchronize()
    tab = prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=25)
    print(tab, flush=True)
    prof.export_chrome_trace(os.path.join(out, f'eager_{name}.json'))
json.dump(res, open(os.path.join(out, 'eagerprof.json'), 'w'), indent=1)
