"""What the fixed-max softcap fix (O normalized by the rounded P's sum, softmax_fold.cuh add_rounded) costs,
on an H100. Not a test:

    python tests/softcap_fixed_timing.py --precompile [--tests] [--kvariants old,...]
    timeout 120 python tests/softcap_fixed_timing.py [--kvariants old,...] --out /tmp/softcap_fixed.json
    ncu --profile-from-start off --section ... python tests/softcap_fixed_timing.py --profile

Shape: issue 12's (bf16, d128, batch 2 x 16 heads x 8k), causal and not. Rows, timed in one process
with samples interleaved (cuflash.timing.time_interleaved: CUDA events, warm-up, median):
  plain      the plain forward (selection)
  cap30      softcap 30, sm90_fwd's heuristic (fold_cap 4, fixed max; this checkout's kernel)
  cap30_NAME the same config compiled from a kernels_cu copy with KVARIANTS[NAME]'s edits ("old":
             the kernel sources before the fix, SASS identical to the previous commit's)
  cap80      softcap 80, the same kernel: 2·80·log2(e) > FIXED_MAX_LOG2_RANGE, the row max runs
  extra rows named by --variants: softcap 30 with the heuristic's fields replaced (KEY=FIELD=VALUE,...)
Columns: ms and x plain (over the plain forward of the same pass).
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

B, S, H, D = 2, 8192, 16, 128
DTYPE = "bf16"   # --dtype
# kernel-source variants (--kvariants): edits of a kernels_cu copy, {name: [(file, old, new)]}, each
# timed as softcap 30 at the heuristic's config compiled from its copy
KVARIANTS = {
    # the kernel before the session-18 fix: no rounded sum, O / l
    "old": [("sm90_fwd.cu", "constexpr bool kRoundedL = kFoldCap >= 3 && !kAlibi;", "constexpr bool kRoundedL = false;")],
    # the session-18 fix as it was: the rounded sum on the CUDA cores (add_rounded), not the tensor cores
    "addsum": [("sm90_fwd.cu", "constexpr bool kRowSumMma = kRoundedL;", "constexpr bool kRowSumMma = false;")],
    # two partial sums per row (even / odd 8-column tiles) for l and lr: shorter FADD chains
    "split": [("softmax_fold.cuh", "    float row_sum = 0.f, row_sum_rounded = 0.f;\n",
               "    float row_sum = 0.f, row_sum_rounded = 0.f, row_sum_odd = 0.f, row_sum_rounded_odd = 0.f;\n"),
              ("softmax_fold.cuh", "            row_sum += x;\n        }\n        add_rounded<RoundTo>(row_sum_rounded,",
               "            (nt % 2 ? row_sum_odd : row_sum) += x;\n        }\n"
               "        add_rounded<RoundTo>(nt % 2 ? row_sum_rounded_odd : row_sum_rounded,"),
              ("softmax_fold.cuh", "    l = l * alpha + row_sum;\n",
               "    l = l * alpha + (row_sum + row_sum_odd);\n"),
              ("softmax_fold.cuh", "lr = lr * alpha + row_sum_rounded;",
               "lr = lr * alpha + (row_sum_rounded + row_sum_rounded_odd);")],
}
# timing-only diagnostics (NOT the softcap): one SFU op per score fewer, either the tanh (t = S·softcap_in)
# or the exp2 (P = the exponent's FFMA alone); what the two SFU ops cost
KVARIANTS["notanh"] = [("softmax_fold.cuh", "                        if (kSoftcap) s = tanh_approx(s * softcap_in);\n"
                        "                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);",
                        "                        if (kSoftcap) s = s * softcap_in;\n"
                        "                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);")]
KVARIANTS["noex2"] = [("softmax_fold.cuh", "                x = exp2_scaled(x, scale_log2, offset_log2);",
                       "                x = fmaf(x, scale_log2, -offset_log2);")]
# the tanh of one 8-column tile in 4 on the FMA / ALU pipes (timing only, a candidate: results are
# compared with the SFU's by the max |O - O(cap30)| line): tanh|y| = (1 - u) / (1 + u) with
# u = 2^(-2 log2(e) |y|) by exp2_poly<4> (2.9e-6), 1 / (1 + u) on [1/2, 1] from the linear start
# 24/17 - 8/17 d (1/17) and two Newton steps (1.2e-5): ~21 instructions in place of one MUFU.TANH
_TANH_EMU = """
__device__ __forceinline__ float tanh_emu(float y) {
    const float u = exp2_poly<4>(-2.885390082f * fabsf(y));
    const float d = 1.f + u;
    float r = fmaf(-0.470588235f, d, 1.411764706f);
    r = r * fmaf(-d, r, 2.f);
    r = r * fmaf(-d, r, 2.f);
    return copysignf((1.f - u) * r, y);
}
"""
KVARIANTS["emutanh"] = [
    ("softmax_fold.cuh", "constexpr float kLazyRescaleLog2 = 8.f;\n", "constexpr float kLazyRescaleLog2 = 8.f;\n" + _TANH_EMU),
    ("softmax_fold.cuh", "                        if (kSoftcap) s = tanh_approx(s * softcap_in);\n"
     "                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);",
     "                        if (kSoftcap) s = nt % 4 == 3 ? tanh_emu(s * softcap_in) : tanh_approx(s * softcap_in);\n"
     "                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);")]
KVARIANTS["old_split"] = KVARIANTS["old"] + KVARIANTS["split"]
# session 21 (cap8): element-level fractions of the folded step's exp2s on exp2_poly (e16_N: N of every
# 16 elements 2·nt + e of a thread's row, the last of each group: a row's first keys stay on the SFU),
# replacing kEmu's tile pattern (so the full mask's heuristic emu 1 is replaced too)
_E16 = "            if (kEmu > 0 && exp2_emulated<kEmu>(nt))"
for _n in (1, 2, 3, 4, 6, 8):
    KVARIANTS[f"e16_{_n}"] = [("softmax_fold.cuh", _E16,
                              f"            if ((((2 * nt + e) + 1) * {_n}) / 16 != ((2 * nt + e) * {_n}) / 16)")]
# and the tanhs: N of every 16 elements (offset by 8 from e16's: other elements) take tanh_emu (above)
_T16 = ("                        if (kSoftcap) s = tanh_approx(s * softcap_in);\n"
        "                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);")
for _n in (1, 2, 4):
    KVARIANTS[f"t16_{_n}"] = [
        ("softmax_fold.cuh", "constexpr float kLazyRescaleLog2 = 8.f;\n", "constexpr float kLazyRescaleLog2 = 8.f;\n" + _TANH_EMU),
        ("softmax_fold.cuh", _T16,
         f"                        if (kSoftcap) s = (((2 * nt + e) + 9) * {_n}) / 16 != (((2 * nt + e) + 8) * {_n}) / 16"
         " ? tanh_emu(s * softcap_in) : tanh_approx(s * softcap_in);\n"
         "                        if (kAlibi) s = fmaf(-slope, fabsf(r - static_cast<float>(nt * 8 + e)), s);")]
KVARIANTS["e16_4_t16_2"] = KVARIANTS["e16_4"] + KVARIANTS["t16_2"]
KVARIANTS["e16_2_t16_1"] = KVARIANTS["e16_2"] + KVARIANTS["t16_1"]
# (session 21's round-1 kvariants "nosplit" / "nosplitmax", the masked blocks' own copy of the fixed-max /
# row-max step, are sm90_fwd's masked_copy 1 / 2 since: --variants 'mc1:masked_copy=1', SASS identical)
KVARIANTS["addsum_split"] = KVARIANTS["addsum"] + KVARIANTS["split"]


def parse_variants(text):
    """'name:field=value,field=value;name2:...' -> {name: {field: value}}"""
    out = {}
    for item in filter(None, (text or "").split(";")):
        name, _, fields = item.partition(":")
        kv = {}
        for f in filter(None, fields.split(",")):
            k, _, v = f.partition("=")
            kv[k] = True if v == "True" else False if v == "False" else int(v)
        out[name] = kv
    return out


def configs(causal, variants):
    from cuflash import registry
    from cuflash.problem import Problem

    fam = registry.get("sm90_fwd")
    plain = Problem("fwd", DTYPE, B, S, S, H, H, D, causal)
    cap = plain.replace(features=("softcap",), softcap=30.0)
    heur = fam.for_problem(fam.heuristic(cap, (9, 0), 227 * 1024), cap)
    # (a name ending in "@full" / "@causal": that mask's row only)
    mask = "causal" if causal else "full"
    extra = {name: heur.replace(**kv) for name, kv in variants.items() if name.partition("@")[2] in ("", mask)}
    return plain, heur, extra


def variant_dir(name, root=""):
    """A kernels_cu copy with KVARIANTS[name]'s edits (each must match once), under root (default
    $CUFLASH_KV_ROOT, else /tmp)."""
    root = root or os.environ.get("CUFLASH_KV_ROOT", "/tmp")
    import shutil
    from pathlib import Path

    from cuflash import compile as cc

    dst = Path(root) / f"cuflash_kv_{name}"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(cc._kernel_dir(""), dst)
    for fname, old, new in KVARIANTS[name]:
        text = (dst / fname).read_text()
        assert text.count(old) == 1, f"variant {name}: {old!r} found {text.count(old)} times in {fname}"
        (dst / fname).write_text(text.replace(old, new))
    return str(dst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvariants", default="old",
                    help="comma-separated KVARIANTS names, each optionally NAME:BASE+BASE (else --kv-bases)")
    ap.add_argument("--profile", action="store_true",
                    help="one call each of plain and cap30 (full) in a profiler range (ncu --profile-from-start off)")
    ap.add_argument("--profile-rows", default="plain,cap30", help="--profile: the rows profiled")
    ap.add_argument("--profile-mask", default="full", choices=("full", "causal"), help="--profile: the mask")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--tests", action="store_true", help="--precompile: also the GPU tests' kernels")
    ap.add_argument("--variants", default="")
    ap.add_argument("--kv-bases", default="cap30",
                    help="rows the kernel-source variants are made for: cap30 (the heuristic) and --variants names")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = ap.parse_args()
    global DTYPE
    DTYPE = args.dtype
    variants = parse_variants(args.variants)
    # {kernel-source variant: the rows (cap30, --variants names) it is made for}
    kvariants = {n.partition(":")[0]: (n.partition(":")[2] or args.kv_bases).split("+")
                 for n in filter(None, args.kvariants.split(","))}
    if any(kv.get("fold_cap") == 4 for kv in variants.values()):
        from cuflash.families import sm90_fwd

        sm90_fwd.FOLD4_TIMING = True   # fold_cap 4 is refused otherwise (its LSE: sm90_fwd.py)
    from cuflash import compile as cc
    from cuflash import registry

    if args.precompile:
        fam = registry.get("sm90_fwd")
        cfgs, olds = [], []
        for causal in (True, False):
            plain, heur, extra = configs(causal, variants)
            olds.append(heur)
            cfgs += [heur, fam.for_problem(fam.heuristic(plain, (9, 0), 227 * 1024), plain), *extra.values()]
        if args.tests:   # tests/test_softcap_fixed_max_gpu.py's kernels and the backward tests'
            from cuflash.families import sm90_fwd
            from cuflash.problem import Problem

            for causal in (True, False):
                for dt in ("bf16", "fp16"):
                    p = Problem("fwd", dt, 2, 1023, 1023, 4, 2, D, causal, features=("softcap",), softcap=4.0)
                    cfgs.append(fam.for_problem(fam.heuristic(p, (9, 0), 227 * 1024), p))
                    for cap in (30.0,):   # (fp16 at cap 30: the row-max step)
                        pc = p.replace(softcap=cap)
                        cfgs.append(fam.for_problem(fam.heuristic(pc, (9, 0), 227 * 1024), pc))
                    for sq, sk in ((1, 1), (2, 1), (1, 2), (3, 3), (5, 2), (2, 7), (17, 300)) * (dt == "bf16"):
                        # (tests/test_softcap_seeds_gpu.py's tiny shapes: bf16)
                        for cap in (5.0, 30.0):
                            for fold in (None, 0, 3) + ((4,) if sm90_fwd.FOLD4_TIMING else ()):
                                pt = p.replace(seqlen_q=sq, seqlen_k=sk, softcap=cap, nheads=2, nheads_kv=2)
                                c = fam.for_problem(fam.heuristic(pt, (9, 0), 227 * 1024), pt)
                                cfgs.append(c if fold is None else c.replace(fold_cap=fold))
                    for name in ("sm90_bwd", "fa2_bwd"):
                        bf = registry.get(name)
                        pb = p.replace(op="bwd")
                        cfgs.append(bf.for_problem(bf.heuristic(pb, (9, 0), 227 * 1024), pb))
        # the tests' CUFLASH_SOFTCAP_FIELDS (test_softcap_fixed_max_gpu.forced_fields): those kernels too
        forced = parse_variants("forced:" + os.environ.get("CUFLASH_SOFTCAP_FIELDS", ""))["forced"]
        if forced and args.tests:
            cfgs += [c.replace(**forced) for c in cfgs if c.family == "sm90_fwd" and c.softcap and c.fold_cap >= 3]
        cfgs = list({c.name: c for c in cfgs if not c.problems()}.values())
        bad = [(c.name, e) for c, _, e in cc.precompile(cfgs) if e]
        for name, bases in kvariants.items():
            these = []
            for causal in (True, False):
                _, heur, extra = configs(causal, variants)
                these += [heur if b == "cap30" else extra[b] for b in bases if b == "cap30" or b in extra]
            os.environ["CUFLASH_KERNEL_DIR"] = variant_dir(name)   # the spawned workers read it at import
            bad += [(c.name, e) for c, _, e in cc.precompile(these) if e]
        print("precompiled", len(cfgs), "failed", bad, flush=True)
        return

    import torch

    import cuflash
    from cuflash.registry import op_flops
    from cuflash.timing import time_interleaved

    rows = []
    for causal in (True, False):
        plain, heur, extra = configs(causal, variants)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16 if DTYPE == "bf16" else torch.float16)
                   for _ in range(3))
        fns = {"plain": lambda: cuflash.flash_attn_func(q, k, v, causal=causal),
               "cap30": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, softcap=30.0),
               "cap80": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, softcap=80.0)}
        for name, cfg in extra.items():
            # (a --variants name with "capN" in it: softcap N, e.g. cap80 the row-max step; else 30)
            cap = float(re.search(r"cap(\d+)", name).group(1)) if re.search(r"cap(\d+)", name) else 30.0
            fns[name] = lambda cfg=cfg, cap=cap: cuflash.flash_attn_func(q, k, v, causal=causal, softcap=cap, config=cfg)
        for fn in fns.values():
            assert not fn().isnan().any()
        if args.profile:
            if (args.profile_mask == "full") == causal:
                continue
            for key in args.profile_rows.split(","):   # (plain, cap30, cap80 and --variants names)
                fns[key]()
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                fns[key]()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print("profiled", key, flush=True)
            return
        new = fns["cap30"]()
        for name in extra:   # a --variants row against the heuristic's output at its softcap (30, 80, or
            # a row named capN alone: the heuristic's config at softcap N)
            cap = re.search(r"cap(\d+)", name)
            ref = "cap30" if not cap else f"cap{cap.group(1)}"
            base_out = fns[ref]() if ref in fns and ref != name else None
            if base_out is not None:
                print(f"{name}: max |O - O(heuristic)| {(fns[name]().float() - base_out.float()).abs().max().item():.3g}",
                      flush=True)
        i = 0
        for name, bases in kvariants.items():
            for base in bases:
                if base != "cap30" and base not in extra:
                    continue
                cfg = heur if base == "cap30" else extra[base]
                i += 1
                # a plan built while the override names the variant's sources holds its kernels; the plan
                # caches key on (problem, strides, scale, config), so each variant takes the scale times
                # (1 + i 2^-20) (same kernel, same time) to keep its own plan (no on_change drop)
                scale = D ** -0.5 * (1 + i * 2.0 ** -20)
                cc._override = variant_dir(name)
                out = cuflash.flash_attn_func(q, k, v, causal=causal, softcap=30.0, config=cfg, softmax_scale=scale)
                cc._override = ""
                fns[f"{base}_{name}"] = (lambda scale=scale, cfg=cfg: cuflash.flash_attn_func(
                    q, k, v, causal=causal, softcap=30.0, config=cfg, softmax_scale=scale))
                print(f"{base}_{name}: max |O - O(cap30)| {(out.float() - new.float()).abs().max().item():.3g}",
                      flush=True)
        torch.cuda.synchronize()
        times = time_interleaved(fns, reps=args.reps, back_to_back=3)
        base = times["plain"].median_ms
        for key, t in times.items():
            tflops = op_flops(plain) / t.median_ms / 1e9
            cfg = extra.get(key.rsplit("_", 1)[0] if key.endswith(tuple(kvariants)) else key, heur) \
                if key != "plain" else plain
            name = getattr(cfg, "name", "")
            print(f"{DTYPE} {'causal' if causal else 'full':7s} {key:14s} {t.median_ms:8.3f} ms {tflops:7.1f} TFLOPs "
                  f"x plain {t.median_ms / base:6.3f}  {name if key != 'plain' else ''}", flush=True)
            rows.append(dict(dtype=DTYPE, causal=causal, row=key, median_ms=t.median_ms, x_plain=t.median_ms / base,
                             spread=t.spread, config=name))
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, shape=[B, S, H, D], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
