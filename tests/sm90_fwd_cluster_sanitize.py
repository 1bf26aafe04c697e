"""Shapes for compute-sanitizer over sm90_fwd's cluster (kCluster: 2-CTA clusters sharing each K/V load
by TMA multicast, remote mbarrier releases) and pv_overlap (kPvOverlap: the K/V loop rotated): run
under it, not under pytest (the kernels of tests/test_sm90_fwd_cluster_gpu.py and
tests/test_sm90_pv_overlap_gpu.py, so a CuPy cache filled by those runs compiles nothing here):

    compute-sanitizer --tool synccheck python tests/sm90_fwd_cluster_sanitize.py
    compute-sanitizer --tool racecheck python tests/sm90_fwd_cluster_sanitize.py

Small shapes (an even number of Q blocks, so that the cluster stays on), each config called twice,
outputs poisoned first and checked for NaN and against the same tile without the flag.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, registry  # noqa: E402

import test_sm90_fwd_cluster_gpu as cl  # noqa: E402

SHAPES = [(1, 256, 300, 2, 1), (2, 1000, 900, 4, 2)]   # (batch, seqlen_q, seqlen_k, nheads, nheads_kv)


def main():
    api.POISON_OUTPUTS = True
    fam = registry.get("sm90_fwd")
    only = sys.argv[1:] or None
    for k in cl.KERNELS:
        if only and cl.kid(k) not in only:
            continue
        cfg, plain = cl.config(k), cl.config(k, False)
        t = {"bf16": torch.bfloat16, "fp16": torch.float16}[k[0]]
        for b, sq, sk, h, hkv in SHAPES:
            q = torch.randn(b, sq, h, k[1], device="cuda", dtype=t)
            kk, v = (torch.randn(b, sk, hkv, k[1], device="cuda", dtype=t) for _ in range(2))
            p = cuflash.Problem("fwd", k[0], b, sq, sk, h, hkv, k[1], False)
            assert fam.for_problem(cfg, p).cluster
            outs = [cuflash.flash_attn_func(q, kk, v, config=cfg) for _ in range(2)]
            ref = cuflash.flash_attn_func(q, kk, v, config=plain)
            torch.cuda.synchronize()
            for out in outs:
                assert not out.isnan().any(), f"{cfg.name} {b}x{sq}x{sk}: unwritten (NaN) outputs"
                assert torch.equal(out, ref), f"{cfg.name} {b}x{sq}x{sk}: differs from {plain.name}"
            print(f"ok {cfg.name} b{b} {sq}x{sk} h{h}:{hkv}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
