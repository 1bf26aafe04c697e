"""Shapes for compute-sanitizer over sm90_fwd's dynamic scheduler and TMA-store epilogue: run under
it, not under pytest (the kernels of tests/test_sm90_sched_gpu.py, so a CuPy cache filled by that
run compiles nothing here):

    compute-sanitizer --tool memcheck python tests/sm90_sched_sanitize.py
    compute-sanitizer --tool racecheck python tests/sm90_sched_sanitize.py
    compute-sanitizer --tool synccheck python tests/sm90_sched_sanitize.py

Each config runs every shape twice (the second call sees the counter its first call reset), and
the outputs are checked for NaN (outputs are poisoned first) and against each other across
configs of the same shape (the same tiles, other schedules: within bf16 rounding).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal): more tiles than SMs in the last
    (1, 17, 113, 4, 1, True), (2, 203, 113, 4, 2, True), (1, 300, 1, 2, 2, False),
    (2, 1100, 900, 16, 4, True),
]
CHANGES = [  # (head dim, changes to the heuristic's tile)
    (128, dict(persistent=True, dynamic=True)),
    (64, dict(persistent=True, dynamic=True, tma_store=True)),
    (128, dict(persistent=True, dynamic=True, tma_store=True, BN=160)),
    (128, dict(BM=64, consumers=1, pingpong=False, BN=128, tma_store=True)),
]


def main():
    api.POISON_OUTPUTS = True
    fam = registry.get("sm90_fwd")
    arch = _gpu.arch()
    for b, sq, sk, h, hkv, causal in SHAPES:
        for d, change in CHANGES:
            p = Problem("fwd", "bf16", b, sq, sk, h, hkv, d, causal)
            cfg = fam.heuristic(p, arch, _gpu.max_smem()).replace(**change).validate(_gpu.max_smem())
            q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            outs = [cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg) for _ in range(2)]
            plain = cuflash.flash_attn_func(q, k, v, causal=causal)
            torch.cuda.synchronize()
            for out in outs:
                assert not out.isnan().any(), f"{cfg.name} {b}x{sq}x{sk}: unwritten (NaN) outputs"
                err = (out.float() - plain.float()).abs().max().item()
                assert err < 2e-2, f"{cfg.name} {b}x{sq}x{sk}: differs from the default by {err:.3g}"
            print(f"ok {cfg.name} b{b} {sq}x{sk} h{h}:{hkv} {'causal' if causal else 'full'}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
