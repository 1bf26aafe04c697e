"""What softcap costs in the backward (sm90_bwd), on an H100. Not a test:

    python tests/softcap_bwd_timing.py --precompile [--tests] [--kvariants bnotanh,...]
    timeout 120 python tests/softcap_bwd_timing.py [--kvariants bnotanh,...] --out /tmp/softcap_bwd.json

Shape: issue 12's (bf16 or fp16, d128, batch 2 x 16 heads x 8k), causal and not. Rows per mask, timed in
one process with samples interleaved (cuflash.timing.time_interleaved: CUDA events, warm-up, median):
  bwd plain        the backward alone of the plain call (torch.autograd.grad of one retained forward)
  bwd cap30        the same with softcap 30 (the backward by selection: sm90_bwd's heuristic)
  bwd cap30_NAME   the same backward kernel compiled from a kernels_cu copy with KVARIANTS[NAME]'s edits
  fwdbwd plain / cap30 / cap30_NAME   forward + backward (out.backward)
Columns: ms and x plain (over the plain call of the same pass).
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]   # the checkout (and softcap_fixed_timing's variant_dir)

B, S, H, D = 2, 8192, 16, 128
CAP = 30.0
# kernel-source variants of the backward: {name: [(file, old, new)]}. Diagnostics (timing only, NOT softcap):
#   bnotanh  the recomputed score's tanh replaced by its argument (one MUFU per score fewer)
#   bnoword  1 - t² neither stored to the thread's shared-memory words nor applied to dSᵀ
# and of the folded step's software exp2 (cap_fold 3: a quarter of the exp2s on the FMA pipes, exp2_emu.cuh; give the
# row cap_fold=3, e.g. --kvariants bemu8:cap_fold=3), and of the unfolded one (the heuristic's):
#   bemu8 / bemu2  cap_fold 3 with 1/8 or 1/2 of the exp2s on the FMA pipes instead of 1/4
#   b0emu4         the unfolded step (cap_fold 0) with 1/4 of them there (nt odd, half 1)
_TANH = "            t = tanh_approx(s * softcap_in);\n"
_EMU3 = "kCapFold == 3 && r == 3 ? exp2_poly<3>"
_EXP0 = ("                            s = exp2_scaled(score.apply(s, q0 + nt * 8 + 2 * t + e, key, th), p.scale_log2,\n"
         "                                            e ? lse.y : lse.x);\n")


KVARIANTS = {
    "bemu8": [("sm90_bwd.cu", _EMU3, "kCapFold == 3 && r == 3 && e == 1 ? exp2_poly<3>")],
    "bemu2": [("sm90_bwd.cu", _EMU3, "kCapFold == 3 && r % 2 == 1 ? exp2_poly<3>")],
    "b0emu4": [("sm90_bwd.cu", _EXP0,
                "                            s = score.apply(s, q0 + nt * 8 + 2 * t + e, key, th);\n"
                "                            s = nt % 2 == 1 && half == 1 ? exp2_poly<3>(fmaf(s, p.scale_log2, "
                "-(e ? lse.y : lse.x)))\n"
                "                                                         : exp2_scaled(s, p.scale_log2, e ? lse.y : lse.x);\n")],
    "bnotanh": [("score.cuh", _TANH, "            t = s * softcap_in;\n")],
    "bnoword": [("sm90_bwd.cu",
                 "                        if constexpr (kSoftcap) thread_word(kCapWord0 + 2 * nt + half) = "
                 "pack2<Elem>(dtanh[0], dtanh[1]);\n", "                        (void)dtanh;\n"),
                ("sm90_bwd.cu",
                 "                        dp_acc[0][nt][e] *= to_float<Elem>(u16(e % 2 ? dtanh >> 16 : dtanh & 0xFFFFu));\n",
                 "                        (void)dtanh;\n")],
}


def problems(causal, dtype):
    from cuflash.problem import Problem

    plain = Problem("bwd", dtype, B, S, S, H, H, D, causal)
    return plain, plain.replace(features=("softcap",), softcap=CAP)


def bwd_config(p):
    from cuflash import registry

    fam = registry.get("sm90_bwd")
    return fam.for_problem(fam.heuristic(p, (9, 0), 227 * 1024), p)


def cap_fold_test_configs(head_dims) -> list:
    """tests/test_sm90_bwd_cap_fold_gpu.py's kernels at these head dims: its forced backwards (the plain
    heuristic's config with cap_fold, through for_problem as the call does) and the default forwards."""
    from test_features_gpu import HEADS
    from test_sm90_bwd_cap_fold_gpu import SHAPES, fold_config

    from cuflash import registry
    from cuflash.problem import Problem

    out = []
    fwd, bwd = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    for d in head_dims:
        for dtype in ("bf16", "fp16") if d == 128 else ("bf16",):
            for causal in (True, False):
                forms = [fold_config(form, dtype, d, causal, (9, 0)) for form in (1, 2, 3) if form == 1 or dtype == "bf16"]
                for cap in (5.0, 30.0, 50.0) if d == 128 else (30.0,):
                    for sq, sk, heads in SHAPES if d == 128 else SHAPES[::2]:
                        h, hkv = HEADS[heads]
                        p = Problem("fwd", dtype, 2, sq, sk, h, hkv, d, causal, features=("softcap",), softcap=cap)
                        out.append(fwd.for_problem(fwd.heuristic(p, (9, 0), 227 * 1024), p))
                        pb = p.replace(op="bwd")
                        out += [bwd.for_problem(cfg, pb) for cfg in forms]
    return out


def main():
    global CAP
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvariants", default="",
                    help="comma-separated KVARIANTS names, each optionally NAME:field=value+field=value (that "
                         "row's config fields, over --kv-fields)")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--tests", default="",
                    help="--precompile: also tests/test_sm90_bwd_cap_fold_gpu.py's kernels, of these head dims "
                         "(e.g. 128 or 64,128,256)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--mask", default="both", choices=("causal", "full", "both"))
    ap.add_argument("--no-fwdbwd", action="store_true")
    ap.add_argument("--cap", type=float, default=CAP, help="the softcap of the softcap rows (rows still named cap30)")
    ap.add_argument("--variants", default="",
                    help="'name:field=value,...;...': softcap rows at the backward heuristic's config, fields "
                         "replaced")
    ap.add_argument("--kv-fields", default="",
                    help="'field=value,...': the kernel-source variants' rows at the heuristic's config with these "
                         "fields replaced (e.g. cap_fold=2 for the folded step's variants)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    CAP = args.cap
    from softcap_fixed_timing import KVARIANTS as FWD_KV, parse_variants, variant_dir

    variants = parse_variants(args.variants)
    kv_fields = parse_variants("kv:" + args.kv_fields)["kv"]

    FWD_KV.update(KVARIANTS)   # (variant_dir reads that table)
    # {kernel-source variant: the config fields of its row}
    kvs = {n.partition(":")[0]: {**kv_fields, **parse_variants("kv:" + n.partition(":")[2].replace("+", ","))["kv"]}
           for n in args.kvariants.split(",") if n}
    masks = {"causal": (True,), "full": (False,), "both": (True, False)}[args.mask]
    from cuflash import compile as cc

    if args.precompile:
        from cuflash import registry

        fam = registry.get("sm90_fwd")
        cfgs = []
        for causal in masks:
            for p in problems(causal, args.dtype):
                fp = p.replace(op="fwd")
                cfgs += [fam.for_problem(fam.heuristic(fp, (9, 0), 227 * 1024), fp), bwd_config(p)]
                if p.features:
                    cfgs += [bwd_config(p).replace(**kv) for kv in variants.values()]
        cfgs += cap_fold_test_configs([int(d) for d in filter(None, args.tests.split(","))])
        cfgs = list({c.name: c for c in cfgs}.values())
        bad = [(c.name, e) for c, _, e in cc.precompile(cfgs) if e]
        for name, fields in kvs.items():
            os.environ["CUFLASH_KERNEL_DIR"] = variant_dir(name)
            bad += [(c.name, e) for c, _, e in cc.precompile([bwd_config(problems(m, args.dtype)[1]).replace(**fields)
                                                              for m in masks]) if e]
        print("precompiled", len(cfgs), "failed", bad, flush=True)
        return

    import torch

    import cuflash
    from cuflash.timing import time_interleaved

    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    for causal in masks:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dt).requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        bcfg = bwd_config(problems(causal, args.dtype)[1])
        calls = {"plain": (dict(), None, None), "cap30": (dict(softcap=CAP), None, bcfg)}
        calls.update({name: (dict(softcap=CAP), None, bcfg.replace(**kv)) for name, kv in variants.items()})
        for i, (name, fields) in enumerate(kvs.items()):
            # a distinct softmax_scale (same kernel speed) so that the variant keeps its own plan
            scale = D ** -0.5 * (1 + (i + 1) * 2.0 ** -20)
            calls[f"cap30_{name}"] = (dict(softcap=CAP, softmax_scale=scale), name, bcfg.replace(**fields))
        bwd, fwdbwd, grads = {}, {}, {}
        for key, (kw, kv, cfg) in calls.items():
            out = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg, **kw)
            if kv:
                cc._override = variant_dir(kv)
            grads[key] = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)   # builds the plan
            cc._override = ""
            bwd[key] = (lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))

            def fb(kw=kw, cfg=cfg):
                o = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg, **kw)
                return torch.autograd.grad(o, (q, k, v), dout)
            fwdbwd[key] = fb
        for key in grads:
            if key != "plain" and key != "cap30":
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[key], grads["cap30"]))
                print(f"{key}: max |dX - dX(cap30)| {err:.3g} (kvariants: diagnostics, not softcap)", flush=True)
        torch.cuda.synchronize()
        passes = [("bwd", bwd)] + ([] if args.no_fwdbwd else [("fwdbwd", fwdbwd)])
        for pname, fns in passes:
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            times = time_interleaved(fns, reps=args.reps, back_to_back=3)
            base = times["plain"].median_ms
            for key, t in times.items():
                print(f"{args.dtype} {'causal' if causal else 'full':7s} {pname:7s} {key:16s} {t.median_ms:8.3f} ms "
                      f"x plain {t.median_ms / base:6.3f}  {calls[key][2].name if key != 'plain' else ''}", flush=True)
                rows.append(dict(dtype=args.dtype, causal=causal, pass_=pname, row=key, median_ms=t.median_ms,
                                 x_plain=t.median_ms / base, spread=t.spread,
                                 config=calls[key][2].name if key != "plain" else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=dict(device=torch.cuda.get_device_name(), torch=torch.__version__),
                           shape=[B, S, H, D], cap=CAP, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
