"""Timing of the varlen backward with features on the H100 (issue 12; sm90_bwd VARLEN_SMALL_D_FEATURES):
sm90_bwd's varlen kernel with window / softcap / ALiBi / dropout against fa2_bwd's (what selection runs
there today), both forced by config=, in the same process, interleaved and shuffled
(cuflash.timing.time_interleaved). Not a test; about a minute with its compiles (done first, in
parallel):

    timeout 170 python tests/sm90_varlen_bwd_features_timing.py --hdims 64 --out /tmp/vbf.json
    timeout 100 python tests/sm90_varlen_bwd_features_timing.py --hdims 128 --features alibi+window \
        alibi+dropout --fwd-features alibi+dropout      # mixes (session 25), the forward timed too

Cases, bf16, heads = 2048 / d, 16k tokens in all (tests/sm90_varlen_timing.py's lengths): "mixed"
(512..8k) and "short" (64..1k), full and causal, each with one feature: window (256 left; non-causal
also 256 right), softcap 30, ALiBi (slopes per head), dropout 0.1. The forward is the selection's
(varlen_torch.forward_features, config None), its out and LSE feed both backwards. Before timing, dQ /
dK / dV of sm90_bwd are compared with fa2_bwd's (max difference over the largest fa2 gradient; the same
dropout mask: the canonical keep mask both regenerate). "x fa2" is ms / fa2_bwd's ms (< 1: sm90_bwd
faster). A mix ("alibi+dropout", features joined by '+') sets each of its features as above; with
--fwd-features the forward rows too: sm90_fwd's varlen heuristic against fa2_fwd's, forced, "x fa2" over
fa2_fwd's ms. A family whose supports() refuses the call gets no row (its op untimed for that case).
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CUFLASH_VARLEN_CHECK", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry, varlen, varlen_torch  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

from sm90_varlen_timing import TOTAL, lengths  # noqa: E402

FEATURES = ("window", "softcap", "alibi", "dropout")


def feature_args(feature, causal, h):
    """(slopes, window, softcap, dropout_p) of a call with this feature, or this mix of them
    ("alibi+dropout": the features joined by '+')."""
    mix = feature.split("+")
    slopes = (torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda").float()
              if "alibi" in mix else None)
    window = (256, 0 if causal else 256) if "window" in mix else (-1, -1)
    return slopes, window, 30.0 if "softcap" in mix else 0.0, 0.1 if "dropout" in mix else 0.0


def case(kind, d, causal, feature, fwd_rows=False):
    """(info, {family: backward config}, forward config, make) of one case; make() draws the inputs, runs
    the forward and returns {family: backward call} (after the compiles)."""
    from cuflash import _gpu, select

    h = 2048 // d
    lens = lengths(kind)
    nseq, mx = len(lens), max(lens)
    slopes_on = "alibi" in feature.split("+")
    _, window, softcap, p_drop = feature_args(feature.replace("alibi", ""), causal, h)
    pf, pb = (varlen.features_problem(op, "bf16", nseq, mx, mx, h, h, d, causal, window, softcap,
                                      False if slopes_on else None, p_drop) for op in ("fwd", "bwd"))
    fwd_cfg = select.choose(pf, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]
    cfgs, fwd_cfgs = {}, {}
    for name in ("fa2_bwd", "sm90_bwd"):
        fam = registry.get(name)
        if not fam.supports(_gpu.arch(), pb):
            cfgs[name] = fam.for_problem(fam.heuristic(pb), pb)
    for name in ("fa2_fwd", "sm90_fwd") if fwd_rows else ():
        fam = registry.get(name)
        if not fam.supports(_gpu.arch(), pf):
            fwd_cfgs[name] = fam.for_problem(fam.heuristic(pf), pf)
    cfgs, fwd_cfgs = (c if len(c) == 2 else {} for c in (cfgs, fwd_cfgs))   # (one family alone: nothing to time)

    def make():
        cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")
        q, k, v, dout = (torch.randn(TOTAL, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        slopes = feature_args(feature, causal, h)[0]
        rng = torch.tensor([1234, 0], dtype=torch.int64, device="cuda") if p_drop else None
        scale = 1 / math.sqrt(d)
        out, lse = varlen_torch.forward_features(q, k, v, cu, cu, mx, mx, scale, causal, slopes, window, softcap,
                                                 p_drop, rng, fwd_cfg)

        def bwd(cfg):
            return lambda: varlen_torch.backward_features(dout, q, k, v, out, lse, cu, cu, mx, mx, scale, causal,
                                                          False, slopes, window, softcap, p_drop, rng, cfg)

        def fwd(cfg):
            return lambda: varlen_torch.forward_features(q, k, v, cu, cu, mx, mx, scale, causal, slopes, window,
                                                         softcap, p_drop, rng, cfg)

        return {name: bwd(cfg) for name, cfg in cfgs.items()}, {name: fwd(cfg) for name, cfg in fwd_cfgs.items()}

    return dict(lens=lens, h=h), {**cfgs, **fwd_cfgs}, fwd_cfg, make


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64])
    ap.add_argument("--features", nargs="+", default=list(FEATURES),
                    help="features or mixes of them joined by '+' (alibi+dropout); 'window@96': at head dim 96 only")
    ap.add_argument("--fwd-features", nargs="*", default=[],
                    help="of --features, those whose forward is timed too (sm90_fwd vs fa2_fwd, both forced)")
    ap.add_argument("--kinds", nargs="+", default=["mixed", "short"])
    ap.add_argument("--out", default="")
    ap.add_argument("--precompile-only", action="store_true")
    args = ap.parse_args()
    # "feature@d": that feature (or mix) at head dim d only
    at = [(int(f.split("@")[1]), f.split("@")[0]) if "@" in f else (d, f) for f in args.features for d in args.hdims]
    cases = [(kind, d, causal, f) for d, f in dict.fromkeys(at) for kind in args.kinds for causal in (False, True)]
    built = [case(*c, fwd_rows=c[3] in args.fwd_features) for c in cases]
    from cuflash.compile import precompile

    kernels = {cfg.kernel_name(): cfg for _, cfgs, fwd_cfg, _ in built for cfg in (*cfgs.values(), fwd_cfg)}
    failed = [(c.name, e[-1500:]) for c, _, e in precompile(list(kernels.values())) if e]
    assert not failed, failed
    print(f"compiled {len(kernels)} kernels", flush=True)
    if args.precompile_only:
        return
    results = []
    print(f"{'case':<40} {'row':<9} {'config':<64} {'ms':>8} {'x fa2':>7} {'spread':>6}")
    for (kind, d, causal, feature), (info, cfgs, _, make) in zip(cases, built):
        name = f"{kind} d{d} {'causal' if causal else 'full'} {feature}"
        bwds, fwds = make()
        for op, fns in (("bwd", bwds), ("fwd", fwds)):
            if f"sm90_{op}" not in fns or f"fa2_{op}" not in fns:
                if fns:
                    print(f"{name:<40} {op}: sm90_{op} does not run it (supports())", flush=True)
                continue
            ga, gb = fns[f"fa2_{op}"](), fns[f"sm90_{op}"]()
            big = max(g.float().abs().max().item() for g in ga)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ga, gb)) / max(big, 1e-6)
            nan = any(g.isnan().any().item() for g in gb)
            print(f"{name:<40} sm90_{op} vs fa2_{op}: max diff / max |out| {diff:.2e}{' NaN!' if nan else ''}")
            torch.cuda.synchronize()
            times = time_interleaved(fns, reps=args.reps, back_to_back=3)
            base = times[f"fa2_{op}"].median_ms
            for key, t in times.items():
                print(f"{name:<40} {key:<9} {cfgs[key].name:<64} {t.median_ms:8.3f} {t.median_ms / base:7.3f} "
                      f"{t.spread:6.3f}", flush=True)
                results.append(dict(case=name, kind=kind, head_dim=d, causal=causal, feature=feature, op=op,
                                    row=key, config=cfgs[key].name, median_ms=t.median_ms,
                                    x_fa2=t.median_ms / base, spread=t.spread, rel_diff=diff, nan=nan))
        del bwds, fwds
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuflash=cuflash.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, total_tokens=TOTAL, rows=results), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
