"""Timing of sm90_fwd's dynamic persistent scheduler (``dynamic``) on an H100 (issue 11: the forward
at >= 1.0x SDPA cuDNN in every cell >= 2k). Not a test; < 3 min:

    timeout 300 python tests/sm90_fwd_sched_timing.py --out /tmp/sched_timing.json

Cases: bf16, head dims 64 / 128 / 256, seqlen 2k / 4k / 8k / 16k, causal and not, the benchmark's
shape (dim 2048: heads = 2048 / d; batch x seqlen = 16k). Rows per case, samples interleaved
(cuflash.timing.time_interleaved, CUDA events, warm-up, median of --reps samples of 5 calls):
  tuned      the tuned table's entry for the case, read from the shipped table without its code
             hash check (the hash changes with the kernel source; the entry's tile is what counts)
  dyn        the same tile, persistent, with the dynamic scheduler
  dyn_tma    the same with the TMA-store epilogue, at the largest BN <= the tuned one whose O
             staging tiles fit shared memory (d128: 160 for 176; d256 fits none with 2 consumers)
  dyn_bnN    (--sweep-bn) the dynamic scheduler at other BNs of the space
  sdpa_cudnn torch SDPA on cuDNN, same tensors
"x cuDNN" is the row's TFLOPs / cuDNN's. Every forced kernel is compiled up front in parallel.
"""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry, select  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning", "configs",
                     "NVIDIA_H100_80GB_HBM3_sm90.yaml")


def tuned_config(fam, problem):
    """The shipped table's sm90_fwd entry for the problem's (dtype, head dim, causal, seqlen), code
    hash not checked; else the heuristic."""
    for e in select.read_file(TABLE).entries:
        if (e.family, e.dtype, e.head_dim, e.causal, e.seqlen, tuple(e.features)) == \
                (fam.name, problem.dtype, problem.head_dim, problem.causal, problem.seqlen_q, ()):
            return fam.make(dict(e.config), problem), "table"
    return fam.heuristic(problem), "heuristic"


def case_rows(d, s, causal, variants, sweep_bn=()):
    fam = registry.get("sm90_fwd")
    h, b = 2048 // d, 16384 // s
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    problem = Problem("fwd", "bf16", b, s, s, h, h, d, causal)
    tuned, source = tuned_config(fam, problem)
    fields = {f.name for f in dataclasses.fields(tuned)}
    rows = {"tuned": (f"tuned ({source})", tuned)}
    if "dyn" in variants:
        rows["dyn"] = ("dynamic scheduler", tuned.replace(persistent=True, dynamic=True))
    if "dyn_tma" in variants and "tma_store" in fields:
        # at the tuned BN, else the largest BN below it whose staging tiles fit shared memory
        tma = tuned.replace(persistent=True, dynamic=True, tma_store=True)
        while tma.problems(227 * 1024) and tma.BN > 64:
            tma = tma.replace(BN=tma.BN - 16)
        rows["dyn_tma"] = (f"dynamic + TMA store BN{tma.BN}", tma)
    for bn in sweep_bn:    # the dynamic scheduler at other BNs (the tile it would tune to)
        if bn != tuned.BN:
            rows[f"dyn_bn{bn}"] = (f"dynamic scheduler BN{bn}", tuned.replace(persistent=True, dynamic=True, BN=bn))
    out = {}
    for key, (label, cfg) in rows.items():
        why = cfg.problems(227 * 1024)
        if why:
            print(f"  skipped {cfg.name}: {'; '.join(why)}")
            continue
        out[key] = (label, cfg, lambda cfg=cfg: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg))
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    out["sdpa_cudnn"] = ("SDPA cuDNN", None, sdpa)
    return problem, out, (q, k, v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--variants", default="dyn,dyn_tma")
    ap.add_argument("--sweep-bn", default="", help="also the dynamic scheduler at these BNs, e.g. 128,144,160,192")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    variants = set(args.variants.split(","))
    cases = [(d, s, c) for d in map(int, args.dims.split(",")) for s in map(int, args.seqlens.split(","))
             for c in (False, True)]
    from cuflash.compile import precompile

    sweep = tuple(int(x) for x in args.sweep_bn.split(",") if x)
    built = [case_rows(*c, variants, sweep) for c in cases]
    cfgs = list(dict.fromkeys(cfg for _, rows, _ in built for _, cfg, _ in rows.values() if cfg is not None))
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    assert not failed, failed
    results = []
    print(f"{'case':<22} {'row':<26} {'config':<62} {'ms':>8} {'TFLOPs':>7} {'x cuDNN':>8}")
    for (d, s, causal), (problem, rows, tensors) in zip(cases, built):
        case = f"d{d} s{s} {'causal' if causal else 'full'}"
        fns = {key: fn for key, (_, _, fn) in rows.items()}
        ref = None
        for key, fn in fns.items():   # compile / plan outside the timing; outputs agree
            out = fn()
            if key == "sdpa_cudnn":
                continue
            assert not out.isnan().any(), f"{case} {key}: NaN in the output"
            if ref is None:
                ref = out
            else:
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 2e-2, f"{case} {key}: differs from the tuned row by {err:.3g}"
        torch.cuda.synchronize()
        times = time_interleaved(fns, reps=args.reps, back_to_back=5)
        cudnn = op_flops(problem) / times["sdpa_cudnn"].median_ms / 1e9
        for key, t in times.items():
            label, cfg, _ = rows[key]
            tflops = op_flops(problem) / t.median_ms / 1e9
            name = cfg.name if cfg is not None else ""
            print(f"{case:<22} {label:<26} {name:<62} {t.median_ms:8.3f} {tflops:7.1f} {tflops / cudnn:8.3f}",
                  flush=True)
            results.append(dict(case=case, head_dim=d, seqlen=s, causal=causal, batch=problem.batch,
                                heads=problem.nheads, row=key, label=label, config=name,
                                median_ms=t.median_ms, tflops=tflops, x_cudnn=tflops / cudnn,
                                spread=t.spread))
        del tensors
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   cudnn=torch.backends.cudnn.version(), cuflash=cuflash.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=results), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
