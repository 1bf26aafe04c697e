"""Edge shapes for compute-sanitizer (memcheck, racecheck): run under it, not under pytest.

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py

Every kernel family runs: the forward, and the backward (preprocess, main kernel, dQ
epilogue, GQA reduction) through torch autograd, in both key-group layouts (qsplit 1
and 2), plus the deterministic backward.
"""
import torch

import cuflash
from cuflash import _gpu

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, hdim, causal)
    (1, 1, 1, 2, 2, 64, False), (1, 17, 113, 4, 1, 40, True), (2, 203, 113, 4, 2, 128, True),
    (1, 113, 203, 2, 2, 256, False), (1, 130, 130, 2, 1, 96, True), (1, 1, 300, 2, 2, 128, True),
]


def bwd_variants(d, dtype, causal):
    """The heuristic backward and its other key-group layout (qsplit 1 <-> 2), when valid."""
    base = cuflash.bwd_config_for(d, dtype, causal)
    other = base.replace(qsplit=3 - base.qsplit, warps=8 if base.qsplit == 1 else base.warps)
    return [base] + ([other] if not other.problems(_gpu.max_smem()) else [])


for b, sq, sk, h, hkv, d, causal in SHAPES:
    for dtype in (torch.bfloat16, torch.float16):
        name = "bf16" if dtype == torch.bfloat16 else "fp16"
        for bwd_config in bwd_variants(d, name, causal):
            q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
                    for _ in range(2))
            out = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=bwd_config)
            out.backward(torch.randn_like(out))
q = torch.randn(1, 150, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
cuflash.flash_attn_func(q, q, q, causal=True, deterministic=True).sum().backward()
torch.cuda.synchronize()
print("sanitize shapes done")
