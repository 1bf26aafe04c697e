"""Varlen on the Hopper families under compute-sanitizer (memcheck / racecheck / synccheck): run
under it, not under pytest (sm_90 only). Small odd-length batches, so every Q block and K/V box
runs past a sequence's end into the next one's rows and past the packed end:

    compute-sanitizer --tool memcheck python tests/sm90_varlen_sanitize.py

sm90_fwd varlen, a CTA per tile and persistent, causal and not, d64 and d128, GQA; sm90_bwd varlen
(switched on here: VARLEN_BWD) with its heuristic (dq_writer) at d128 and the deterministic
red.add kernel at d64. Prints one line per call; the sanitizer's summary says whether any access
was out of bounds.

    compute-sanitizer --tool memcheck python tests/sm90_varlen_sanitize.py --mixes alibi+window \
        dropout+softcap --hdims 64 128

runs instead the feature mixes given (features joined by '+'; session 25's VARLEN_FEATURES): each one's
sm90_fwd and sm90_bwd varlen heuristic kernels (forced, where supports() takes the mix), GQA, causal at the
first head dim and alternating after, window (37, 0) / (50, 20), softcap 10, ALiBi slopes per head,
dropout 0.17. --precompile compiles their kernels (no launches), to run first outside the sanitizer.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cuflash import registry, varlen_torch  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

LENS_Q = [1, 17, 0, 113, 300, 5]
LENS_K = [1, 30, 9, 200, 113, 0]


def run_mixes(mixes, hdims, precompile_only):
    """Each mix's sm90 varlen forward and backward at each head dim (module docstring)."""
    from cuflash import _gpu, select, varlen

    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    cu_q = torch.tensor(np.cumsum([0] + LENS_Q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + LENS_K), dtype=torch.int32, device="cuda")
    mq, mk = max(LENS_Q), max(LENS_K)
    h, hkv = 4, 2
    runs = []
    for i, (mix, d) in enumerate((m, d) for m in mixes for d in hdims):
        feats, causal = mix.split("+"), (i + i // len(hdims)) % 2 == 0
        window = ((37, 0) if causal else (50, 20)) if "window" in feats else (-1, -1)
        softcap, p_drop = (10.0 if "softcap" in feats else 0.0), (0.17 if "dropout" in feats else 0.0)
        args = ("bf16", len(LENS_Q), mq, mk, h, hkv, d, causal, window, softcap,
                False if "alibi" in feats else None, p_drop)
        pf, pb = (varlen.features_problem(op, *args) for op in ("fwd", "bwd"))
        # (a mix sm90_fwd refuses: the selection's forward, for out and LSE; one sm90_bwd refuses: no backward)
        cf = fwd.for_problem(fwd.heuristic(pf), pf) if not fwd.supports(_gpu.arch(), pf) else \
            select.choose(pf, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]
        cb = bwd.for_problem(bwd.heuristic(pb), pb) if not bwd.supports(_gpu.arch(), pb) else None
        runs.append((mix, d, causal, window, softcap, p_drop, cf, cb))
    if precompile_only:
        from cuflash.compile import precompile

        cfgs = [c for r in runs for c in r[6:] if c is not None]
        failed = [(c.name, e[-800:]) for c, _, e in precompile(cfgs) if e]
        print(f"precompiled {len(cfgs)} kernels; failed: {failed}")
        return
    for mix, d, causal, window, softcap, p_drop, cf, cb in runs:
        q = torch.randn(sum(LENS_Q), h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(LENS_K), hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        slopes = (torch.tensor([2.0 ** (-8 * (j + 1) / h) for j in range(h)], device="cuda").float()
                  if "alibi" in mix else None)
        rng = torch.tensor([1234, 5], dtype=torch.int64, device="cuda") if p_drop else None
        scale = 1 / math.sqrt(d)
        out, lse = varlen_torch.forward_features(q, k, v, cu_q, cu_k, mq, mk, scale, causal, slopes, window,
                                                 softcap, p_drop, rng, cf)
        torch.cuda.synchronize()
        grads = () if cb is None else varlen_torch.backward_features(
            dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal, False, slopes, window, softcap, p_drop, rng, cb)
        torch.cuda.synchronize()
        print(f"{mix} d{d} {'causal' if causal else 'full'}: {cf.name} out finite {bool(out.isfinite().all())}; "
              f"{cb.name if cb else '(sm90_bwd refuses it)'} grads finite {all(bool(g.isfinite().all()) for g in grads)}",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixes", nargs="*", default=[], help="feature mixes (alibi+window ...) instead of the plain calls")
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--precompile", action="store_true")
    args = ap.parse_args()
    if args.mixes:
        return run_mixes(args.mixes, args.hdims, args.precompile)
    sm90_bwd.VARLEN_BWD = True
    cu_q = torch.tensor(np.cumsum([0] + LENS_Q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + LENS_K), dtype=torch.int32, device="cuda")
    mq, mk = max(LENS_Q), max(LENS_K)
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    for d, causal, det in ((64, True, True), (128, False, False), (128, True, False)):
        h, hkv = 4, 2
        q = torch.randn(sum(LENS_Q), h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(LENS_K), hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        p = Problem("fwd", "bf16", len(LENS_Q), mq, mk, h, hkv, d, causal, False, ("varlen",))
        for persistent in (False, True):
            cfg = fwd.for_problem(fwd.heuristic(p), p).replace(persistent=persistent)
            out, lse = varlen_torch.forward(q, k, v, cu_q, cu_k, mq, mk, scale, causal, cfg)
            torch.cuda.synchronize()
            print(f"{cfg.name}: out finite {bool(out.isfinite().all())}", flush=True)
        pb = p.replace(op="bwd", deterministic=det)
        cfg = bwd.for_problem(bwd.heuristic(pb), pb)
        grads = varlen_torch.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, scale, causal, det, cfg)
        torch.cuda.synchronize()
        print(f"{cfg.name}: grads finite {all(bool(g.isfinite().all()) for g in grads)}", flush=True)


if __name__ == "__main__":
    main()
