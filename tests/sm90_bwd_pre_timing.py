"""Per-kernel GPU time of one backward (torch.profiler / CUPTI) on an H100 (issue 14): cuflash's
preprocess, main kernel and dQ convert against SDPA cuDNN's dot_do_o, main kernel and convert, bf16,
dim 2048 (heads = 2048 / d), batch x seqlen = 16k, head dims 64 and 128, seqlens 2k and 16k, causal
and not (the shapes of results/NVIDIA_H100_80GB_HBM3/logs/session13_prof/bwdbreak.json, which holds
the numbers before the preprocess and shared-store changes: preprocess 137 us at d128 and 189 at d64,
sm90_bwd d128 1366 / 790 / 10063 / 4779 us at 2k, 2k causal, 16k, 16k causal). Also the
preprocess's any-strides path (a dout whose row stride is not whole 16-byte chunks: the preprocess
copies it) once per head dim, for reference. Not a test; < 3 min with a warm compile cache.

    timeout 300 python tests/sm90_bwd_pre_timing.py --out /tmp/pre.json

--ab: instead, sm90_bwd's main kernel with the shared-store changes against the same kernel with
the old stores (dS by 16-bit stores, dq_writer staging with its 2-way bank conflicts), compiled
from an edited copy of kernels_cu/ (cuflash.compile.set_kernel_dir; old_stores_dir below), in
new / old / new / old blocks on the same GPU, d128 (and d64 with --hdims) at the shapes above.

Prints one JSON line per (impl, d, s, causal), then a table: the preprocess / main / convert
times of both and main-kernel ratio cuflash / cuDNN (< 1: faster than cuDNN).
"""
import argparse
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import cuflash  # noqa: E402

from bwd_timing_common import CAUSALS  # noqa: E402


def kernel_times(fn, reps):
    """{kernel name: mean GPU us per call} of fn() over reps calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.device_time if hasattr(e, "device_time") else e.cuda_time
            times[e.name[:100]] = times.get(e.name[:100], 0.0) + t
    return {n: round(t / reps, 1) for n, t in times.items()}


def role(name):
    """preprocess / main / convert / other, for cuflash's and cuDNN's kernel names."""
    if "preprocess" in name or "dot_do_o" in name:
        return "pre"
    if "convert" in name:
        return "convert"
    if any(m in name for m in ("sm90_bwd<", "fa2_bwd<", "flash_bprop", "dq_dk_dv")):
        return "main"
    return "other"


def by_role(times):
    out = {}
    for n, t in times.items():
        out[role(n)] = round(out.get(role(n), 0.0) + t, 1)
    return out


def old_stores_dir():
    """A copy of kernels_cu/ whose sm90_bwd.cu stores dS 16 bits at a time (the dropout branch's
    code for every kernel) and stages dq_writer's dQ without the nt ^ 2 exchange: the kernel before
    the shared-store changes (its dS offsets recomputed per store rather than kept in 4 registers)."""
    import shutil
    import tempfile
    from pathlib import Path

    from cuflash.compile import kernel_dir

    dst = Path(tempfile.mkdtemp(prefix="cuflash_old_stores_")) / "kernels_cu"
    shutil.copytree(kernel_dir(), dst)
    src = (dst / "sm90_bwd.cu").read_text()
    ds = ("            if constexpr (!kDsDouble) named_barrier_sync(1, kConsumerThreads);\n"
          "            if constexpr (kDropout) {\n")
    odd = "                const bool odd = g % 2;\n"
    assert src.count(ds) == 1 and src.count(odd) == 1, "sm90_bwd.cu changed: update old_stores_dir"
    src = src.replace(ds, ds.replace("kDropout", "true")).replace(odd, odd.replace("g % 2", "false"))
    (dst / "sm90_bwd.cu").write_text(src)
    return dst


def ab(args, causals):
    """New vs old shared stores, sm90_bwd's main kernel, per shape: mean us of 2 blocks each."""
    from cuflash.compile import set_kernel_dir

    old = old_stores_dir()
    rows = []
    for d in args.hdims:
        h = 2048 // d
        for s in args.seqlens:
            b = max(1, 16384 // s)
            for causal in causals:
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                cfg = cuflash_bwd_config(q, causal)
                res = {"new": [], "old": []}
                grads = {}
                for which in ("new", "old", "new", "old"):
                    set_kernel_dir(old if which == "old" else None)
                    o = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg)
                    fn = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
                    r = kernel_times(fn, args.reps)
                    res[which].append(by_role(r).get("main", 0.0))
                    grads[which] = fn()
                set_kernel_dir(None)
                same = all(torch.equal(a, b) for a, b in zip(grads["new"][1:], grads["old"][1:]))
                dq = ((grads["new"][0].float() - grads["old"][0].float()).abs().max()
                      / grads["old"][0].float().abs().max()).item()
                row = {"d": d, "s": s, "causal": causal, "config": cfg.name,
                       "new_us": round(sum(res["new"]) / 2, 1), "old_us": round(sum(res["old"]) / 2, 1),
                       "blocks": res, "dk_dv_equal": same, "dq_rel_diff": dq}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'d':>4} {'s':>6} {'causal':>6} | {'new us':>8} {'old us':>8} | new / old | dk,dv equal  dq rel diff")
    for r in rows:
        print(f"{r['d']:>4} {r['s']:>6} {str(r['causal']):>6} | {r['new_us']:>8} {r['old_us']:>8} | "
              f"{r['new_us'] / r['old_us']:.3f}     | {str(r['dk_dv_equal']):>11}  {r['dq_rel_diff']:.2e}")
    return rows


def cuflash_bwd_config(q, causal):
    """The sm90_bwd config selection picks for this call (the heuristic where the table is stale)."""
    from cuflash import _gpu, registry
    from cuflash.problem import Problem

    b, s, h, d = q.shape
    p = Problem("bwd", "bf16", b, s, s, h, h, d, causal)
    fam = registry.get("sm90_bwd")
    return fam.for_problem(fam.heuristic(p, _gpu.arch(), _gpu.max_smem()), p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--out", default=None, help="JSON file of all rows")
    ap.add_argument("--ab", action="store_true", help="sm90_bwd's new vs old shared stores (see above)")
    args = ap.parse_args()
    causals = CAUSALS[args.causal]
    if args.ab:
        rows = ab(args, causals)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = []

    def emit(row):
        row["roles"] = by_role(row["us"])
        rows.append(row)
        print(json.dumps(row), flush=True)

    for d in args.hdims:
        h = 2048 // d
        for s in args.seqlens:
            b = max(1, 16384 // s)
            for causal in causals:
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                o = cuflash.flash_attn_func(q, k, v, causal=causal)
                r = kernel_times(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), args.reps)
                emit({"impl": "cuflash", "d": d, "s": s, "causal": causal, "us": r})
                if not causal and s == args.seqlens[0]:
                    wide = torch.zeros(b, s, h, d + 3, device="cuda", dtype=torch.bfloat16)
                    wide[..., :d] = do
                    r = kernel_times(lambda: torch.autograd.grad(o, (q, k, v), wide[..., :d], retain_graph=True),
                                     args.reps)
                    emit({"impl": "cuflash_strided_dout", "d": d, "s": s, "causal": causal, "us": r})
                if args.no_cudnn:
                    continue
                qt, kt, vt, dot = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad)
                                   for x in (q, k, v, do))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    r = kernel_times(lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True),
                                     args.reps)
                emit({"impl": "cudnn", "d": d, "s": s, "causal": causal, "us": r})
                del q, k, v, do, o
    print(f"\n{'d':>4} {'s':>6} {'causal':>6} | {'pre':>7} {'main':>8} {'conv':>6} | "
          f"{'cudnn pre':>9} {'main':>8} {'conv':>6} | main ratio")
    for row in rows:
        if row["impl"] != "cuflash":
            continue
        ref = next((x for x in rows if x["impl"] == "cudnn" and (x["d"], x["s"], x["causal"])
                    == (row["d"], row["s"], row["causal"])), None)
        a, c = row["roles"], (ref or {}).get("roles", {})
        ratio = f"{a.get('main', 0) / c['main']:.3f}" if c.get("main") else "-"
        print(f"{row['d']:>4} {row['s']:>6} {str(row['causal']):>6} | {a.get('pre', 0):>7} {a.get('main', 0):>8} "
              f"{a.get('convert', 0):>6} | {c.get('pre', 0):>9} {c.get('main', 0):>8} {c.get('convert', 0):>6} | {ratio}")
    for row in rows:
        if row["impl"] == "cuflash_strided_dout":
            print(f"d{row['d']} s{row['s']}: preprocess with a dout it must copy (any-strides path): "
                  f"{row['roles'].get('pre')} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
