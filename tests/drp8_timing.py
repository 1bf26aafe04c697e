"""Where dropout's overhead goes (issue 12), on an H100: the plain call against the dropout call and its
parts, forward, backward alone and forward + backward, at bf16, batch 2 x 16 heads x 8k, p 0.1 (d128 by
default), full and causal, all in one process:

    python tests/drp8_timing.py --out /tmp/drp8.json            # every row
    python tests/drp8_timing.py --ops fwd --hdims 128 64         # the forward rows only

Forward rows (sm90_fwd, the heuristic's tile): plain (selection's), plain without the TMA-store epilogue
(and, where plain runs the static grid, on the dynamic scheduler the dropout kernel runs), dropout as
selection runs it, and the dropout kernel with the TMA-store epilogue (tmao) and its timing forms
(DROP_EARLY_TIMING, NOT the dropout mask): drop_early 3 (no Philox rounds), 5 (no draw, the flags'
permute and AND kept), 6 (neither: the dropout kernel's epilogue scale only). Backward rows (sm90_bwd):
plain, dropout as selection runs it, and drop_packed 2 with the plain call's speed fields (DROPOUT_FAST's:
dynamic, ds_double, dq_early, dk_late, frag_pin, wide_epi), in the sets --bwd-sets names ("none": the
backward before DROPOUT_FAST), and the
backward's timing form drop_packed 3 (no rounds; DROP_PACKED_TIMING, NOT the mask). Every kernel compiled
first, in parallel; samples are CUDA events, interleaved, shuffled rounds, median (cuflash.timing).
"x plain" is ms / the plain call's ms of the same op. The timed dropout calls draw their seed from torch's
generator (as users' calls do): an explicit dropout_seed makes a device tensor per call, a synchronizing copy
(round 1 of session 27 timed that way: its forward rows carry the copy's wait). With --check, each variant's results against
selection's dropout call's (the same mask: the forward's tmao bit for bit, the backward's gradients within
a relative error); timing forms are not checked. Not a test.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.families import sm90_bwd, sm90_fwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.select import choose_on_device  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

P = 0.1
MAX = 227 * 1024
ALL = dict(dynamic=True, ds_double=True, dq_early=True, dk_late=True, frag_pin=True)
BWD_SETS = {
    "none": {},
    "all_w16": dict(ALL, wide_epi=True),
    "all": dict(ALL),
    "w16": dict(wide_epi=True),
    "dyn": dict(dynamic=True),
    "ds2": dict(ds_double=True),
    "dqe_dkl_pin": dict(dq_early=True, dk_late=True, frag_pin=True),
    "dyn_ds2_w16": dict(dynamic=True, ds_double=True, wide_epi=True),
}


def problems_of(d, causal, b, s, h):
    plain = Problem("fwd", "bf16", b, s, s, h, h, d, causal)
    return plain, plain.replace(features=("dropout",), dropout_p=P)


def fwd_rows(d, causal, b, s, h, forms):
    """{key: (config or None for selection's, label, dropout)} of the forward rows."""
    fam = registry.get("sm90_fwd")
    plain, drop = problems_of(d, causal, b, s, h)
    pcfg = choose_on_device(plain, 0)[1]
    dcfg = choose_on_device(drop, 0)[1]
    rows = {"plain": (None, "plain", False), "dropout": (None, "dropout", True)}
    if pcfg.family == "sm90_fwd":
        rows["plain_notmao"] = (pcfg.replace(tma_store=False), "plain no tmao", False)
        if not pcfg.dynamic:
            rows["plain_dyn"] = (pcfg.replace(dynamic=True, persistent=True, tma_store=False), "plain dyn", False)
    if dcfg.family != "sm90_fwd" or not dcfg.drop_packed:
        return rows
    rows["drop_tmao"] = (dcfg.replace(tma_store=True), "dropout tmao", True)
    if pcfg.family == "sm90_fwd" and not pcfg.dynamic:
        rows["drop_plainsched"] = (dcfg.replace(dynamic=pcfg.dynamic, persistent=pcfg.persistent, tma_store=True),
                                   "dropout, plain's schedule + tmao", True)
    for f in forms:
        for t in ((False, True) if f == 3 else (True,)):   # (3 without tmao too: drp7's row)
            rows[f"dpe{f}{'_tmao' if t else ''}"] = (dcfg.replace(drop_early=f, tma_store=t),
                                                    f"timing dpe{f}{' tmao' if t else ''}", True)
    return {k: (c if c is None else fam.for_problem(c, drop if r else plain), lbl, r)
            for k, (c, lbl, r) in rows.items()
            if c is None or not fam.for_problem(c, drop if r else plain).problems(MAX)}


def bwd_rows(d, causal, b, s, h, sets, timing):
    fam = registry.get("sm90_bwd")
    plain, drop = problems_of(d, causal, b, s, h)
    dsel = choose_on_device(drop.replace(op="bwd"), 0)[1]
    rows = {"plain": (None, "plain", False), "dropout": (None, "dropout", True)}
    if dsel.family != "sm90_bwd":
        return rows
    base = dsel.replace(drop_packed=2, **{k: False for k in sm90_bwd.DROPOUT_FAST_FIELDS})
    for name in sets:
        rows[f"b_{name}"] = (base.replace(**BWD_SETS[name]), f"dpk2 + {name}", True)
    if timing:
        rows["b_dpk3"] = (base.replace(drop_packed=3), "timing dpk3", True)
        rows["b_dpk3_all_w16"] = (base.replace(**BWD_SETS["all_w16"], drop_packed=3), "timing dpk3 + all_w16", True)
    out = {}
    for k, (c, lbl, r) in rows.items():
        if c is not None:
            c = fam.for_problem(c, drop.replace(op="bwd"))
            if c.problems(MAX):
                print(f"skip {k}: {c.name}: {c.problems(MAX)[0][:100]}")
                continue
        out[k] = (c, lbl, r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--ops", nargs="+", default=["fwd", "bwd", "fwdbwd"], choices=("fwd", "bwd", "fwdbwd"))
    ap.add_argument("--forms", type=int, nargs="*", default=[3, 5, 6], help="the forward's timing forms")
    ap.add_argument("--bwd-sets", nargs="*", default=["none", "all_w16"], choices=list(BWD_SETS))
    ap.add_argument("--fwd-rows", nargs="*", default=None, help="only these forward rows (keys), plain and dropout always")
    ap.add_argument("--no-timing-forms", action="store_true", help="no timing forms (fwd nor bwd)")
    ap.add_argument("--fwdbwd-pairs", nargs="*", default=["dropout:b_none"],
                    help="forward + backward rows besides plain / dropout: FWDKEY:BWDKEY (keys of the rows)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    timing = not args.no_timing_forms
    sm90_fwd.DROP_EARLY_TIMING = timing
    sm90_bwd.DROP_PACKED_TIMING = timing
    forms = args.forms if timing else []
    causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    cases = [(d, c, max(1, 16384 // args.seqlen), args.seqlen, 2048 // d) for d in args.hdims for c in causals]

    todo = []
    for case in cases:
        for op in ("fwd", "bwd"):
            for p in problems_of(*case):
                todo.append(choose_on_device(p.replace(op=op), 0)[1])
        todo += [c for c, _, _ in fwd_rows(*case, forms).values() if c is not None]
        todo += [c for c, _, _ in bwd_rows(*case, args.bwd_sets, timing).values() if c is not None]
    res = precompile(list(dict.fromkeys(todo)), 0, processes=min(16, os.cpu_count() or 1))
    bad = [(c.name, e[:200]) for c, _, e in res if e]
    for name, e in bad:
        print("compile failed:", name, e)

    rows = []
    print(f"{'case':<22} {'op':<7} {'row':<34} {'config':<72} {'ms':>8} {'TFLOPs':>7} {'x plain':>8}")
    for d, causal, b, s, h in cases:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        case = f"d{d} {'causal' if causal else 'full'} s{s}"
        plain, drop = problems_of(d, causal, b, s, h)
        frows = fwd_rows(d, causal, b, s, h, forms)
        if args.fwd_rows is not None:
            frows = {k_: r for k_, r in frows.items() if k_ in ("plain", "dropout", *args.fwd_rows)}
        brows = bwd_rows(d, causal, b, s, h, args.bwd_sets, timing)
        seed = 1234

        def fwd(key, seeded=False):
            cfg, _, dr = frows[key]
            return cuflash.flash_attn_func(q, k, v, P if dr else 0.0, causal=causal, config=cfg,
                                           dropout_seed=seed if dr and seeded else None)

        def name_of(op, key):
            if op == "fwd":
                cfg = frows[key][0] or choose_on_device(drop if frows[key][2] else plain, 0)[1]
            else:
                cfg = brows[key][0] or choose_on_device((drop if brows[key][2] else plain).replace(op="bwd"), 0)[1]
            return cfg.name

        if args.check:
            with torch.no_grad():
                ref = fwd("dropout", True)
                for key in ("drop_tmao", "drop_plainsched"):
                    if key in frows:
                        got = fwd(key, True)
                        print(f"check {case} fwd {key}: bitwise {torch.equal(got, ref)}, "
                              f"max |diff| {(got.float() - ref.float()).abs().max().item():.3g}")
            outs = {}
            for key, (cfg, _, dr) in brows.items():
                if not dr or key.startswith("b_dpk3"):
                    continue
                o = cuflash.flash_attn_func(q, k, v, P, causal=causal, bwd_config=cfg, dropout_seed=seed)
                outs[key] = torch.autograd.grad(o, (q, k, v), dout)
            for key, g in outs.items():
                errs = [((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip(g, outs["dropout"])]
                print(f"check {case} bwd {key}: rel. error vs selection's dq {errs[0]:.2e} dk {errs[1]:.2e} "
                      f"dv {errs[2]:.2e} (nan: {any(x.isnan().any().item() for x in g)})")

        for op in args.ops:
            flops = op_flops(plain) * {"fwd": 1, "bwd": 2.5, "fwdbwd": 3.5}[op]
            if op == "fwd":
                fns = {key: (lambda key=key: fwd(key)) for key in frows}
                labels = {key: (frows[key][1], name_of("fwd", key)) for key in frows}
                with torch.no_grad():
                    times = time_interleaved(fns, reps=args.reps, back_to_back=3, order="shuffle")
            elif op == "bwd":
                outs = {key: cuflash.flash_attn_func(q, k, v, P if dr else 0.0, causal=causal, bwd_config=cfg)
                        for key, (cfg, _, dr) in brows.items()}
                fns = {key: (lambda o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
                       for key, o in outs.items()}
                labels = {key: (brows[key][1], name_of("bwd", key)) for key in brows}
                times = time_interleaved(fns, reps=args.reps, back_to_back=3, order="shuffle")
                del outs, fns
            else:
                pairs = {"plain": ("plain", "plain"), "dropout": ("dropout", "dropout")}
                for pr in args.fwdbwd_pairs:
                    fk, bk = pr.split(":")
                    if fk in frows and bk in brows:
                        pairs[pr] = (fk, bk)

                def fb(fk, bk):
                    fcfg, _, dr = frows[fk]
                    o = cuflash.flash_attn_func(q, k, v, P if dr else 0.0, causal=causal, config=fcfg,
                                                bwd_config=brows[bk][0])
                    return torch.autograd.grad(o, (q, k, v), dout)

                fns = {key: (lambda fk=fk, bk=bk: fb(fk, bk)) for key, (fk, bk) in pairs.items()}
                labels = {key: (f"{frows[fk][1]} + {brows[bk][1]}", name_of("fwd", fk) + " + " + name_of("bwd", bk))
                          for key, (fk, bk) in pairs.items()}
                times = time_interleaved(fns, reps=args.reps, back_to_back=3, order="shuffle")
            base = times["plain"].median_ms
            for key, t in times.items():
                lbl, cname = labels[key]
                row = dict(case=case, op=op, row=key, label=lbl, config=cname, ms=t.median_ms,
                           tflops=flops / t.median_ms / 1e9, x_plain=t.median_ms / base, head_dim=d, causal=causal,
                           batch=b, seqlen=s, nheads=h)
                rows.append(row)
                print(f"{case:<22} {op:<7} {lbl[:34]:<34} {cname[:72]:<72} {t.median_ms:8.3f} "
                      f"{row['tflops']:7.1f} {row['x_plain']:8.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
