"""Shapes for compute-sanitizer over sm90_bwd's dq_tail (kDqTail: the writer's per-pair tile counts, the
convert kernel sm90_bwd_dq_tail launched as a programmatic dependent, its tickets and its counter reset): run
under it, not under pytest.

    compute-sanitizer --tool memcheck python tests/dq_tail_sanitize.py
    compute-sanitizer --tool racecheck python tests/dq_tail_sanitize.py
    compute-sanitizer --tool synccheck python tests/dq_tail_sanitize.py

Each case runs the same call with the kernel without dq_tail and twice with it (the second call after the
first one's counter reset), the gradients checked for NaN (outputs poisoned), dk / dv bit for bit the
kernel's without dq_tail, dq within 1e-2 relative (unordered fp32 additions). The kernels are the ones
tests/dq_tail_precompile.py --tests compiles (the GPU test's window and plain configs). --quick: the first two;
--form 1 / 2: dq_tail's form (default 2, the heuristic's).
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api  # noqa: E402

import test_bwd_dq_tail_gpu as t  # noqa: E402

CASES = [  # (causal, window or None, batch, seqlen_q, seqlen_k, nheads, nheads_kv)
    (True, (300, 0), 1, 1023, 1023, 6, 2),      # 6 pairs x 8 K/V tiles on the SMs: every CTA's tiles at once
    (False, (64, 64), 2, 113, 1023, 4, 1),      # MQA, s_q < s_k
    (False, None, 1, 2049, 2049, 4, 4),         # the plain call
    (True, (1024, 0), 3, 2049, 2049, 4, 4),     # more tiles than CTAs: convert CTAs wait for pairs still running
]


FORM = int(sys.argv[sys.argv.index("--form") + 1]) if "--form" in sys.argv else 2


def main():
    api.POISON_OUTPUTS = True
    cases = CASES[:2] if "--quick" in sys.argv else CASES
    for causal, window, b, sq, sk, h, hkv in cases:
        cfg = t.dq_tail_config(causal, window is not None, FORM)
        base = cfg.replace(dq_tail=False)
        torch.manual_seed(0)
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        kw = dict(causal=causal, window_size=window) if window else dict(causal=causal)
        got = []
        for c in (base, cfg, cfg):
            o = cuflash.flash_attn_func(q, k, v, bwd_config=c, **kw)
            g = torch.autograd.grad(o, (q, k, v), dout)
            assert not any(x.isnan().any() for x in g), f"{c.name}: NaN"
            got.append(g)
        for g in got[1:]:
            assert torch.equal(g[1], got[0][1]) and torch.equal(g[2], got[0][2]), f"{cfg.name}: dk / dv differ"
            err = ((g[0].float() - got[0][0].float()).abs().max() / got[0][0].float().abs().max()).item()
            assert err < 1e-2, f"{cfg.name}: dq {err}"
        torch.cuda.synchronize()
        print("ok", cfg.name, (b, sq, sk, h, hkv, window), flush=True)
    print("dq_tail sanitize done")


if __name__ == "__main__":
    main()
