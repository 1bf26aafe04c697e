"""Shapes for compute-sanitizer over sm90_bwd's feature kernels with the plain schedule fields
(FEATURE_SCHED_BUILT): run under it, not under pytest (the
kernels of tests/test_bwd_feature_sched_gpu.py, so a CuPy cache filled by that run or by
tests/bwd_feature_sched_precompile.py compiles nothing here):

    compute-sanitizer --tool racecheck python tests/bwd_feature_sched_sanitize.py [--quick]
    compute-sanitizer --tool synccheck python tests/bwd_feature_sched_sanitize.py [--quick]
    ... --only=softcap_causal-plain,alibi_full-plain     # those (case-variant) pairs only

One small shape per kernel (--quick: bf16, the dynamic scheduler's kernels only), backward twice
(the second call sees the counters its first call reset); gradients checked for NaN (poisoned) and
against the call's default backward (within bf16 rounding).
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api  # noqa: E402

import test_bwd_feature_sched_gpu as gpu_test  # noqa: E402


def main():
    quick = "--quick" in sys.argv
    only = [a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")]
    api.POISON_OUTPUTS = True
    torch.manual_seed(0)
    pairs = [("bf16", v, c) for v, c in gpu_test.PAIRS if not (quick and "grid" in v)]
    if not quick:
        pairs += [("fp16", "plain", c) for c in ("softcap_causal", "alibi_full", "window_full")]
    if only:   # --only=case-variant,...: those pairs (bf16)
        pairs = [p for p in pairs if f"{p[2]}-{p[1]}" in only[0]]
    # (b, sq, sk, h, hkv): a ragged last block, GQA
    b, sq, sk, h, hkv = 1, 300, 257, 4, 2
    for dtype, variant, case in pairs:
        feature, causal, window, softcap, alibi = gpu_test.CASES[case]
        cfg, got = gpu_test.variant_config(dtype, causal, feature, variant)
        t = torch.bfloat16 if dtype == "bf16" else torch.float16
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=t)
        k, v = (torch.randn(b, sk, hkv, 128, device="cuda", dtype=t) for _ in range(2))
        dout = torch.randn_like(q)
        slopes = gpu_test.slopes_for(alibi, b, h)
        kw = dict(causal=causal, window_size=window or ((64, 0) if causal else (64, 64)), softcap=softcap,
                  alibi_slopes=slopes)
        ref = gpu_test.grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, **kw), q, k, v, dout)
        for _ in range(2):
            ours = gpu_test.grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
        torch.cuda.synchronize()
        for name, a, r in zip(("dq", "dk", "dv"), ours, ref):
            assert not a.isnan().any(), f"{got.name} {name}: unwritten (NaN) elements"
            err = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
            assert err < 3e-2, f"{got.name} {name}: differs from the default backward by {err:.3g} (relative)"
        print(f"ok {got.name} {case}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
