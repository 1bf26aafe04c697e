"""Profiled forward calls at the FlashAttention benchmark shape (dim 2048, heads 2048 / d, batch x
seqlen 16k), for ncu --profile-from-start off: per spec one warm-up call, then one call inside the
profiled range. Not a test.

    python tests/sm90_fwd_ncu_probe.py SPEC [SPEC ...]      SPEC = IMPL:D:causal|full:SEQLEN[:dtype[:row]]

IMPL: cuflash (the heuristic's config, or a row of tests/sm90_fwd_cells_timing.py CANDIDATES applied to
it, e.g. st) or cudnn (torch SDPA's cuDNN backend). The cuflash kernels should be compiled already
(tests/sm90_fwd_cells_timing.py --precompile-only)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def callable_of(spec):
    parts = spec.split(":")
    impl, d, mask, s = parts[0], int(parts[1]), parts[2], int(parts[3])
    dtype = parts[4] if len(parts) > 4 else "bf16"
    row = parts[5] if len(parts) > 5 else "heur"
    causal = mask == "causal"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
    if impl == "cuflash":
        import sm90_fwd_cells_timing as t

        fam = registry.get("sm90_fwd")
        p = Problem.fa_convention("fwd", dtype, d, causal, s)
        cfg = fam.for_problem(fam.heuristic(p), p)
        if t.CANDIDATES.get(row):
            cfg = cfg.replace(**t.CANDIDATES[row])
        print(spec, "config", cfg.name, flush=True)
        return lambda: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    print(spec, "SDPA cuDNN", flush=True)

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return call


for spec in sys.argv[1:]:
    fn = callable_of(spec)
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    del fn
    torch.cuda.empty_cache()
