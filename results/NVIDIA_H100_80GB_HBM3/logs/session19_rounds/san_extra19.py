"""compute-sanitizer shapes for session 19's new default paths (after session 18's, san_extra18.py):
the softcap forward's tensor-core row sum (fold 3; bf16 non-causal with emu_exp2 1), the backward's
new heuristic classes (dq_first at d64 / d256 causal / fp16 d128 non-causal, the fp16 d128 causal plain
grid above 4k, the 16-byte dK/dV epilogue), and the CuPy backward's repeat-call path."""
import os
import sys

sys.path.insert(0, os.getcwd())
import numpy as np
import torch

import cuflash

dev, bf, fp = "cuda", torch.bfloat16, torch.float16
torch.manual_seed(3)


def qkv(b, sq, sk, h, hk, d, dt):
    mk = lambda s, hh: torch.randn(b, s, hh, d, device=dev, dtype=dt, requires_grad=True)  # noqa: E731
    return mk(sq, h), mk(sk, hk), mk(sk, hk)


cases = ((bf, 700, 700, 4, 4, 128, True, dict(softcap=30.0)),
         (bf, 700, 900, 4, 2, 128, False, dict(softcap=30.0)),
         (bf, 17, 1, 4, 4, 128, False, dict(softcap=5.0)),
         (fp, 300, 300, 4, 4, 128, True, dict(softcap=3.0)),
         (bf, 1000, 1000, 4, 4, 64, False, {}), (fp, 1000, 1000, 4, 2, 64, True, {}),
         (bf, 1000, 1000, 4, 4, 256, True, {}), (fp, 1000, 1000, 4, 4, 256, True, {}),
         (fp, 1000, 1000, 4, 4, 128, False, {}), (fp, 4160, 4160, 1, 1, 128, True, {}),
         (bf, 777, 777, 4, 4, 96, False, {}))
for dt, sq, sk, h, hk, d, causal, kw in cases:
    q, k, v = qkv(1, sq, sk, h, hk, d, dt)
    for _ in range(2):
        o = cuflash.flash_attn_func(q, k, v, causal=causal, **kw)
        o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok s19", (str(dt), sq, sk, h, hk, d, causal, sorted(kw)), flush=True)

import cupy  # noqa: E402

rng = np.random.default_rng(0)
for shape in ((2, 129, 4, 64), (1, 300, 8, 128)):
    q, k, v, do = (cupy.asarray(rng.standard_normal(shape).astype(np.float16)) for _ in range(4))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    for _ in range(3):   # the first validated, the others through api._bwd_plans
        cuflash.flash_attn_backward(do, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    print("ok s19 cupy bwd", shape, flush=True)
