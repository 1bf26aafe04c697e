"""decode_splitkv_regs with pdl (programmatic dependent launch) for compute-sanitizer (memcheck, racecheck,
synccheck); not a test. bf16, d 128, 32:8 heads, one query row, batch 3 with 3000, 0 and 17 keys
(tests/decode_regs_sanitize.py's inputs): the batch-1 default's kernel (regs 1) and the longer calls' kernel
(regs 6, the early prefetch of 3 interleaved blocks, its L2 copy before the wait) with pdl 1 and 2, at 1 and
3 splits (fused combine), contiguous and paged (page 16, leftpad across pages), append + rotary, and the
separate combine kernel; each config as a chain of 3 back-to-back calls, each call's query the previous
call's output, so every launch has a programmatic predecessor that writes what it reads.

    compute-sanitizer --tool memcheck python tests/decode_pdl_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

from cuflash.decode import kvcache_with_config  # noqa: E402
from decode_regs_sanitize import _regs_config, batch3_inputs  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def chain(cfg, q, kc, vc, n=3, **kw):
    for _ in range(n):
        q = kvcache_with_config(cfg, q, kc, vc, **kw)[0]
    return n


def main():
    base = _regs_config(Problem("decode", "bf16", 3, 1, 3000, 32, 8, 128))
    q, kc, vc, lens, pad, table, kp, vp = batch3_inputs()
    cos, sin = (torch.rand(3008, 64, device="cuda").to(torch.bfloat16) for _ in range(2))
    runs, names = 0, []
    for pdl in (1, 2):
        for cfg in (base.replace(pdl=pdl),
                    base.replace(regs=6, regs_order=1, regs_prefetch=True, regs_prefetch_blocks=3, pdl=pdl)):
            names.append(cfg.name)
            for splits in (1, 3):
                runs += chain(cfg, q, kc, vc, cache_seqlens=lens, num_splits=splits)
                runs += chain(cfg.replace(regs_order=0, regs_prefetch=False, regs_prefetch_blocks=1), q, kp, vp,
                              cache_seqlens=lens, block_table=table, cache_leftpad=pad, num_splits=splits)
        cfg = base.replace(pdl=pdl)
        kn, vn = (torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        runs += chain(cfg, q, kc, vc, cache_seqlens=torch.tensor([2000, 0, 17], device="cuda", dtype=torch.int32),
                      k=kn, v=vn, rotary_cos=cos, rotary_sin=sin, num_splits=3)
        sep = cfg.replace(fused_combine=False, light_fence=False)
        names.append(sep.name)
        runs += chain(sep, q, kc, vc, cache_seqlens=lens, num_splits=3)
    torch.cuda.synchronize()
    print(f"{runs} pdl calls ok: {', '.join(names)}")


if __name__ == "__main__":
    main()
