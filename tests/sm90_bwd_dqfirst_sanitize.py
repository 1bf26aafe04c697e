"""Shapes for compute-sanitizer over sm90_bwd's dq_first (kDqFirst: producer warp 2 zeroing the dQ accumulator's
Q blocks, the per-Q-block tickets, one more taker of the dynamic scheduler's tile ring): run under it, not under
pytest.

    compute-sanitizer --tool memcheck python tests/sm90_bwd_dqfirst_sanitize.py
    compute-sanitizer --tool racecheck python tests/sm90_bwd_dqfirst_sanitize.py
    compute-sanitizer --tool synccheck python tests/sm90_bwd_dqfirst_sanitize.py

Each config runs its shape twice (the second call's tickets zeroed by its own preprocess, its accumulator
holding the first call's sums), the gradients checked for NaN (outputs poisoned) and against the same
kernel without dq_first (dk, dv equal bit for bit, and between the two calls; dq within 1e-2 relative: unordered
fp32 additions). --quick: the first two cases; --cases i,j,...: those of CASES.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

CASES = [  # (dtype, head dim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal)
    ("bf16", 128, 1, 600, 600, 32, 8, False),    # the dynamic scheduler: 160 tiles on 132 CTAs
    ("bf16", 256, 1, 300, 333, 2, 2, True),      # roles: dQ staged in the ring slot
    ("bf16", 128, 2, 1100, 1100, 8, 2, False),   # 144 tiles of 18 Q blocks
    ("fp16", 128, 1, 700, 900, 4, 4, True),      # with dq_convert
    ("bf16", 64, 1, 1023, 1023, 4, 1, False),    # the BM 128 tile
    ("fp16", 128, 1, 700, 700, 4, 4, False),     # without dq_convert (the heuristic's since session 19)
    ("fp16", 64, 1, 700, 700, 4, 2, False),      # the BM 128 tile with q_rotate
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    api.POISON_OUTPUTS = True
    fam = registry.get("sm90_bwd")
    cases = CASES[:2] if "--quick" in sys.argv else CASES
    if "--cases" in sys.argv:   # --cases i,j,...: those of CASES (0-based)
        cases = [CASES[int(i)] for i in sys.argv[sys.argv.index("--cases") + 1].split(",")]
    for dtype, d, b, sq, sk, h, hkv, causal in cases:
        p = Problem("bwd", dtype, b, sq, sk, h, hkv, d, causal)
        base = fam.for_problem(fam.heuristic(p, _gpu.arch()).replace(dq_first=False), p)
        cfg = fam.for_problem(base.replace(dq_first=True), p)
        assert cfg.dq_first and not cfg.problems(), cfg.name
        torch.manual_seed(0)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=DTYPES[dtype], requires_grad=True)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=DTYPES[dtype], requires_grad=True)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=DTYPES[dtype], requires_grad=True)
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=DTYPES[dtype])
        got = {}
        for c in (base, cfg, cfg):
            o = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=c)
            g = torch.autograd.grad(o, (q, k, v), dout)
            assert not any(x.isnan().any() for x in g), f"{c.name}: NaN"
            if c.dq_first and c.name in got:
                assert all(torch.equal(x, y) for x, y in zip(g[1:], got[c.name][1:])), f"{c.name}: dk / dv differ"
            got[c.name] = g
        ref, new = got[base.name], got[cfg.name]
        assert torch.equal(ref[1], new[1]) and torch.equal(ref[2], new[2]), f"{cfg.name}: dk / dv differ"
        err = ((ref[0].float() - new[0].float()).abs().max() / ref[0].float().abs().max()).item()
        assert err < 1e-2, f"{cfg.name}: dq {err}"
        torch.cuda.synchronize()
        print("ok", cfg.name, (b, sq, sk, h, hkv), f"dq diff {err:.1e}", flush=True)
    print("dq_first sanitize done")


if __name__ == "__main__":
    main()
