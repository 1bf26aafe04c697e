"""Timing of sm90_bwd's head-dim-256 tile on an H100 (issue 14): the backward alone, the d256
kernel (BM64 BN64 c2, the consumers sharing the keys; dQ by red.add) plain ("sm90") and with
overlap_sdp ("sm90_ovl"), next to fa2_bwd's heuristic (and its H100 table entry where that
differs, "fa2_tuned") and SDPA's cuDNN and flash backends, in one process: bf16, 8 heads,
batch x seqlen = 16k, seqlens 2k..16k, causal and not, head dims 256 and 192 (192: the d256
kernel with zero-filled columns; fa2_bwd and SDPA run it natively):

    timeout 300 python tests/sm90_bwd_d256_timing.py --out d256.json
    python tests/sm90_bwd_d256_timing.py --hdims 256 --seqlens 16384 --causal no --reps 20

All kernels (the forwards too) are compiled first in parallel processes
(cuflash.compile.precompile). Each case checks every sm90 variant's gradients against fa2_bwd's
(relative max difference <= 1e-2; a larger one prints "MISMATCH"), then times torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
with CUDA events, 3 warm-up calls, the samples of all variants interleaved, the median
(cuflash.timing.time_interleaved). TFLOPs: the backward's FA convention (2.5 x 4 b h s^2 d, / 2
causal, d the real head dim). A backend SDPA refuses prints "skipped". Not a test.

Success: every row prints, no NaN / MISMATCH; the summary lines give, per case, sm90 / fa2_bwd
and sm90 / cuDNN speed ratios (> 1: sm90 faster), which decide D256_ABOVE_FA2 in
cuflash/families/sm90_bwd.py; --out writes the rows and the device as JSON.
"""
import argparse
import json
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # this folder; cuflash from the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, registry  # noqa: E402
from cuflash.bench.common import grad_fn  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.select import choose  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

TOKENS, HEADS = 16384, 8
VARIANTS = {"sm90": {}, "sm90_ovl": dict(overlap_sdp=True)}   # name: flags of the d256 tile
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sm90_kernels(names, p):
    """{variant: config} of the d256 tile for problem p (head dim <= 256), as the call runs it."""
    fam = registry.get("sm90_bwd")
    out = {}
    for name in names:
        cfg = Sm90BwdConfig(64, 64, 2, 2, 256, p.dtype, p.causal, **VARIANTS[name])
        assert fam.for_problem(cfg, p) == cfg and not cfg.problems(), (cfg.name, cfg.problems())
        out[name] = cfg
    return out


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def sdpa_fn(q, k, v, dout, causal, backend):
    """SDPA with one backend, (b, s, h, d) tensors viewed as (b, h, s, d); the backward alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def f(q, k, v):
        with sdpa_kernel(be):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    return grad_fn(f, q, k, v, dout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=list(TORCH_DTYPES))
    ap.add_argument("--hdims", type=int, nargs="+", default=[256, 192])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    fa2 = registry.get("fa2_bwd")
    dev = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    t0 = time.time()
    dtype, tdt = args.dtype, TORCH_DTYPES[args.dtype]

    # every kernel first, in parallel: the backwards, and the forwards selection picks per case
    todo = []
    for d in args.hdims:
        for causal in causals:
            p = Problem("bwd", dtype, 1, 2048, 2048, HEADS, HEADS, d, causal)
            todo += list(sm90_kernels(args.variants, p).values())
            todo.append(fa2.for_problem(fa2.heuristic(p, cc), p))
            for s in args.seqlens:
                bwd = Problem("bwd", dtype, max(1, TOKENS // s), s, s, HEADS, HEADS, d, causal)
                todo.append(fa2.for_problem(fa2.heuristic(bwd, cc), bwd))
                todo.append(choose(bwd, cc, _gpu.name(), _gpu.max_smem(), family=fa2)[1])
                todo.append(choose(bwd.replace(op="fwd"), cc, _gpu.name(), _gpu.max_smem())[1])
    todo = list(dict.fromkeys(todo))
    errors = [(c.name, e) for c, _, e in precompile(todo) if e]
    assert not errors, errors
    print(f"{dev}  sm90_bwd d256 tile (backward alone), torch {torch.__version__}; "
          f"{len(todo)} kernels compiled in {time.time() - t0:.0f} s", flush=True)
    print(f"{'case':<28} {'variant':<11} {'kernel':<48} {'ms':>8} {'TFLOPs':>7} {'x fa2':>6} "
          f"{'x cuDNN':>7} {'dq diff':>8} {'dkv diff':>8}", flush=True)
    rows, summary = [], []
    for d in args.hdims:
        for s in args.seqlens:
            for causal in causals:
                b = max(1, TOKENS // s)
                p = Problem("bwd", dtype, b, s, s, HEADS, HEADS, d, causal)
                q, k, v, dout = (torch.randn(b, s, HEADS, d, device="cuda", dtype=tdt) for _ in range(4))
                kernels = sm90_kernels(args.variants, p)
                fa2_cfg = fa2.for_problem(fa2.heuristic(p, cc), p)
                kernels["fa2_bwd"] = fa2_cfg
                tuned = choose(p, cc, _gpu.name(), _gpu.max_smem(), family=fa2)[1]
                if tuned != fa2_cfg:   # the H100 table's fa2_bwd entry (what selection runs there)
                    kernels["fa2_tuned"] = tuned
                fns = {name: grad_fn(lambda q, k, v, cfg=cfg: cuflash.flash_attn_func(
                    q, k, v, causal=causal, bwd_config=cfg), q, k, v, dout) for name, cfg in kernels.items()}
                for backend in ("cudnn", "flash"):
                    try:   # (the forward runs here)
                        fns[f"sdpa_{backend}"] = sdpa_fn(q, k, v, dout, causal, backend)
                    except RuntimeError as e:
                        print(f"sdpa_{backend}: skipped ({str(e).splitlines()[0][:120]})", flush=True)
                results = {}
                for name, fn in list(fns.items()):   # compile / load outside the timing, fail loudly here
                    try:
                        g = fn()
                    except RuntimeError as e:
                        if not name.startswith("sdpa"):
                            raise
                        print(f"{name}: skipped ({str(e).splitlines()[0][:120]})", flush=True)
                        del fns[name]
                        continue
                    assert not any(x.isnan().any() for x in g), f"{name}: NaN in the gradients"
                    results[name] = g
                torch.cuda.synchronize()
                times = time_interleaved(fns, warmup=3, reps=args.reps, back_to_back=1)
                case = f"{dtype} d{d} {'causal' if causal else 'full'} b{b} s{s}"
                flops = op_flops(p)
                t_fa2 = times["fa2_bwd"].median_ms
                t_cudnn = times["sdpa_cudnn"].median_ms if "sdpa_cudnn" in times else float("nan")
                ref = results["fa2_bwd"]
                for name in fns:
                    t = times[name].median_ms
                    label = kernels[name].name if name in kernels else name
                    ddq = rel(results[name][0], ref[0])
                    dkv = max(rel(results[name][1], ref[1]), rel(results[name][2], ref[2]))
                    flag = "  MISMATCH" if name in kernels and max(ddq, dkv) > 1e-2 else ""
                    print(f"{case:<28} {name:<11} {label:<48} {t:8.3f} {flops / t / 1e9:7.1f} {t / t_fa2:6.3f} "
                          f"{t / t_cudnn:7.3f} {ddq:8.1e} {dkv:8.1e}{flag}", flush=True)
                    rows.append(dict(dtype=dtype, hdim=d, causal=causal, seqlen=s, batch=b, heads=HEADS,
                                     variant=name, kernel=label, ms=t, tflops=flops / t / 1e9,
                                     x_fa2=t / t_fa2, x_cudnn=t / t_cudnn, dq_rel_diff=ddq, dkv_rel_diff=dkv,
                                     mismatch=bool(flag)))
                best = min(args.variants, key=lambda n: times[n].median_ms)
                t_best = times[best].median_ms
                t_fa2_best = min(times[n].median_ms for n in ("fa2_bwd", "fa2_tuned") if n in times)
                summary.append(f"{case:<28} best sm90 {best:<9} {flops / t_best / 1e9:6.1f} TFLOPs  "
                               f"{t_fa2_best / t_best:5.2f}x fa2_bwd (best of heuristic / tuned)  "
                               f"{t_cudnn / t_best:5.2f}x cuDNN (speed)")
                del q, k, v, dout, fns, results
                torch.cuda.empty_cache()
    print("\n".join(summary))
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                           convention="FA: bwd FLOPs = 2.5 x 4 b h s^2 d (/2 causal)", rows=rows), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
