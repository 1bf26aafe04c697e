"""The feature backward on sm90_bwd against the plain call (issue 12 / 14: softcap and ALiBi within 1.10x
the plain call, backward and forward + backward; window 1024 within 1.15x its visible fraction), on an
H100. Not a test.

Shape: bench --mode features' (bf16, d128, batch 2 x 16 heads x 8k; softcap 30, ALiBi (nheads,) slopes,
window (1024, 0) causal / (1024, 1024) full). Per mask, in one process, samples interleaved
(cuflash.timing.time_interleaved: CUDA events, warm-up, median):
  * fwd:    the plain call and each feature's forward (selection's configs);
  * bwd:    the backward alone (torch.autograd.grad of one retained forward's output) of the plain
            call and of every backward variant of each feature (VARIANTS: "heur" = selection's
            config, the rest the named schedule fields over it);
  * fwdbwd: forward + backward of the same rows.
Columns: ms, x plain (over the plain call of the same pass), x visible (the window's x plain over its
visible fraction, cuflash.band.visible_fraction), and the backward config. The configs selection
picks (plain and feature calls) are printed first.

    timeout 80 python tests/sm90_bwd_features_timing.py --out /tmp/feat_bwd.json [--breakdown]
    python tests/sm90_bwd_features_timing.py --precompile        # compile every kernel and stop
    python tests/sm90_bwd_features_timing.py --variants heur plain --features softcap --mask full
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # the checkout

from cuflash import registry  # noqa: E402
from cuflash.band import visible_fraction  # noqa: E402

import features_overhead_timing as overhead  # noqa: E402
from features_overhead_timing import BATCH, CAP, HEAD_DIM, HEADS, SEQLEN, WINDOW  # noqa: E402
FEATURES = ("softcap", "alibi", "window")
PLAIN = dict(dynamic=True, ds_double=True, dq_early=True, dk_late=True, frag_pin=True)
# variant: the schedule fields over selection's backward config (None: selection's own)
VARIANTS = {
    "heur": None,
    "plain": PLAIN,                                           # the plain call's fields
    "grid": dict(PLAIN, dynamic=False),                       # ... on the plain grid
    "dyn": dict(dynamic=True),                                # the dynamic scheduler alone
}
DEFAULT_VARIANTS = ("heur", "plain", "grid")


def problem(feature, causal, op="fwd", seqlen=SEQLEN):
    """features_overhead_timing's Problem of one (feature, mask), for op."""
    return overhead.problem(feature, causal, seqlen).replace(op=op)


def chosen(p):
    """selection's config for problem p (on this GPU)."""
    from cuflash import _gpu, select
    return select.choose(p, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]


def bwd_variants(feature, causal, names, seqlen=SEQLEN):
    """[(variant, config)] of one feature's backward (the feature's own flags set by for_problem);
    variants that the config refuses, or that equal an earlier one, are left out."""
    fam = registry.get("sm90_bwd")
    p = problem(feature, causal, "bwd", seqlen)
    heur = chosen(p)
    out, seen = [], set()
    for name in names:
        kw = VARIANTS[name]
        cfg = heur if kw is None else fam.for_problem(heur.replace(**kw), p)
        if cfg in seen or cfg.problems():
            continue
        seen.add(cfg)
        out.append((name, cfg))
    return out


def all_configs(masks, features, names, seqlen=SEQLEN):
    cfgs = []
    for causal in masks:
        for feature in (None,) + tuple(features):
            cfgs.append(chosen(problem(feature, causal, "fwd", seqlen)))
            if feature is None:
                cfgs.append(chosen(problem(None, causal, "bwd", seqlen)))
            else:
                cfgs += [c for _, c in bwd_variants(feature, causal, names, seqlen)]
    return list(dict.fromkeys(cfgs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=SEQLEN)
    ap.add_argument("--out", default="")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--features", nargs="+", default=list(FEATURES), choices=FEATURES)
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--mask", choices=("causal", "full", "both"), default="both")
    ap.add_argument("--breakdown", action="store_true",
                    help="also the backward's GPU time by kernel role (preprocess / main / convert / other; "
                         "torch.profiler, mean of 3 calls) of the plain call's and the window's backward rows")
    ap.add_argument("--passes", nargs="+", default=["fwd", "bwd", "fwdbwd"], choices=("fwd", "bwd", "fwdbwd"))
    args = ap.parse_args()
    masks = {"causal": (True,), "full": (False,), "both": (False, True)}[args.mask]

    from cuflash.compile import precompile
    cfgs = all_configs(masks, args.features, args.variants, args.seqlen)
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    print(f"compiled {len(cfgs)} kernels; failed: {failed}", flush=True)
    if args.precompile:
        return
    broken = {name for name, _ in failed}    # (their rows are left out, the rest timed)

    import torch
    import cuflash
    from cuflash.timing import time_interleaved

    b, s, h, d = BATCH, args.seqlen, HEADS, HEAD_DIM
    rows = []
    for causal in masks:
        mask = "causal" if causal else "full"
        print(f"== {mask}: selection's configs")
        for feature in (None,) + tuple(args.features):
            print(f"  {feature or 'plain':8} fwd {chosen(problem(feature, causal, 'fwd', s)).name}")
            print(f"  {feature or 'plain':8} bwd {chosen(problem(feature, causal, 'bwd', s)).name}")
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda", dtype=torch.float32)
        kwargs = {None: {}, "window": dict(window_size=WINDOW[causal]), "softcap": dict(softcap=CAP),
                  "alibi": dict(alibi_slopes=slopes)}
        vis = visible_fraction(s, s, causal, WINDOW[causal])
        entries = {"plain": (None, "heur", None)}
        for feature in args.features:
            for name, cfg in bwd_variants(feature, causal, args.variants, s):
                if cfg.name in broken:
                    continue
                entries[f"{feature}:{name}"] = (feature, name, cfg)

        def fwd_fn(feature):
            return lambda: cuflash.flash_attn_func(q, k, v, causal=causal, **kwargs[feature])

        def fwdbwd_fn(feature, bcfg):
            def fn():
                cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=bcfg, **kwargs[feature]).backward(dout)
            return fn

        def bwd_fn(feature, bcfg):
            out = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=bcfg, **kwargs[feature])
            return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        passes = []
        if "fwd" in args.passes:
            passes.append(("fwd", {"plain": fwd_fn(None), **{f"{f}:heur": fwd_fn(f) for f in args.features}}))
        if "bwd" in args.passes:
            passes.append(("bwd", {n: bwd_fn(f, c) for n, (f, _, c) in entries.items()}))
        if "fwdbwd" in args.passes:
            passes.append(("fwdbwd", {n: fwdbwd_fn(f, c) for n, (f, _, c) in entries.items()}))
        if args.breakdown:
            from sm90_bwd_pre_timing import by_role, kernel_times
            for name, (feature, variant, cfg) in entries.items():
                if feature not in (None, "window"):
                    continue    # (the window's and the plain call's: the rest have the plain call's kernels)
                roles = by_role(kernel_times(bwd_fn(feature, cfg), 3))
                print(f"{mask:<7} breakdown {name:<16} " + " ".join(f"{k} {v:.0f}us" for k, v in sorted(roles.items())),
                      flush=True)
                rows.append(dict(mask=mask, pass_="breakdown", feature=feature or "plain", variant=variant,
                                 config=cfg.name if cfg is not None else "", roles=roles))
        for pass_name, fns in passes:
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            times = time_interleaved(fns, reps=args.reps, back_to_back=3)
            plain = times["plain"].median_ms
            for name, t in times.items():
                feature, variant, cfg = entries.get(name, (name.split(":")[0], "heur", None))
                feature = None if feature == "plain" else feature
                x_plain = t.median_ms / plain
                x_vis = x_plain / vis if feature == "window" else None
                cname = cfg.name if cfg is not None else ""
                if pass_name == "fwd":
                    cname = chosen(problem(feature, causal, "fwd", s)).name
                print(f"{mask:<7} {pass_name:<7} {feature or 'plain':<8} {variant:<6} {t.median_ms:8.3f} "
                      f"{x_plain:7.3f} {'' if x_vis is None else f'{x_vis:7.3f}':>7}  {cname}", flush=True)
                rows.append(dict(mask=mask, pass_=pass_name, feature=feature or "plain", variant=variant,
                                 config=cname, median_ms=t.median_ms, spread=t.spread, x_plain=x_plain,
                                 x_visible=x_vis))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), shape=dict(batch=b, seqlen=s, heads=h, head_dim=d),
                           rows=rows), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
