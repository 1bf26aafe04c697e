"""Quick timing of the FP8 (e4m3) forward on an H100 (issue 11's 1.5x cuDNN bf16 bar), next to
SDPA cuDNN bf16 and cuflash bf16 on the same inputs (bf16 rounded to e4m3, descales 1):

    timeout 300 python tests/fp8_timing.py --out /tmp/fp8_timing.json
    python tests/fp8_timing.py --hdims 256 --seqlens 16384 --causal no     # one cell

Per case (FlashAttention convention: heads = 2048 / d, batch x seqlen = 16k):
  * whole calls, CUDA events, samples interleaved (cuflash.timing.time_interleaved): sdpa_cudnn
    (bf16), cuflash (bf16, the config in force), fp8 (flash_attn_func on e4m3 inputs with three
    (1,) descales: checks, the prepare kernel, the main kernel);
  * kernel-only for fp8: torch.profiler's device time per launch of the prepare kernel
    (sm90_fwd_fp8_prepare: Vᵀ and descales) and of the main kernel, over --reps calls;
  * TFLOPs by the FA convention (4·b·h·s²·d, ÷2 causal) and each impl's ratio to cuDNN.
Then the host time per call (CPU clock, 2000 calls of a tiny problem 1x128x4x64 without
synchronizing; the GPU work is too small to throttle the host): fp8 with descales, cuflash
bf16, SDPA cuDNN.
Every kernel of the cases is compiled first, in parallel (cuflash.compile.precompile). The
JSON (--out) holds one record per (case, impl) and the host times. Not a test.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu  # noqa: E402
from cuflash.bench.common import sdpa  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.select import choose  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402


def kernel_times(fn, reps: int) -> dict:
    """{kernel name: mean device ms per call} of fn() over reps calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us:
            out[e.key] = out.get(e.key, 0.0) + us / 1e3 / reps
    return out


def host_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON file for the records")
    ap.add_argument("--ignore-stamps", action="store_true",
                    help="use tuned entries whatever their code-hash stamp (a branch whose edit left the "
                         "tuned kernels' SASS unchanged but changed the hash of their source)")
    ap.add_argument("--no-host", action="store_true", help="skip the host time per call (its tiny "
                    "problem's kernels are compiled on the spot, not in parallel)")
    args = ap.parse_args()
    causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    if args.ignore_stamps:
        from cuflash import select

        select.stale_reasons = lambda entry, stamp: []
    arch, gpu, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    cases = [(d, s, c) for d in args.hdims for s in args.seqlens for c in causals]

    def problem(d, s, causal, dtype):
        return Problem("fwd", dtype, max(1, 16384 // s), s, s, 2048 // d, 2048 // d, d, causal)

    chosen = {}
    for d, s, c in cases:
        for dtype in ("bf16", "e4m3"):
            chosen[(d, s, c, dtype)] = choose(problem(d, s, c, dtype), arch, gpu, smem)
    t0 = time.perf_counter()
    from cuflash.compile import precompile

    failed = [(c.name, err) for c, _, err in precompile([cfg for _, cfg, _ in chosen.values()]) if err]
    assert not failed, failed
    print(f"{gpu}: compiled {len(chosen)} kernel modules in {time.perf_counter() - t0:.0f} s")
    print(f"{'case':<24} {'impl':<12} {'ms':>8} {'TFLOPs':>7} {'x cuDNN':>7}  config / kernels")
    records = []
    one = torch.ones(1, device="cuda")
    for d, s, causal in cases:
        p = problem(d, s, causal, "bf16")
        torch.manual_seed(0)
        q, k, v = (torch.randn(p.batch, s, p.nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        _, cfg16, src16 = chosen[(d, s, causal, "bf16")]
        _, cfg8, src8 = chosen[(d, s, causal, "e4m3")]
        cudnn = sdpa("sdpa_cudnn", causal)
        fns = {"sdpa_cudnn": lambda: cudnn(q, k, v),
               "cuflash": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg16),
               "fp8": lambda: cuflash.flash_attn_func(q8, k8, v8, causal=causal, config=cfg8,
                                                      q_descale=one, k_descale=one, v_descale=one)}
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        times = time_interleaved(fns, reps=args.reps, back_to_back=3)
        kt = kernel_times(fns["fp8"], args.reps)
        prep = sum(ms for name, ms in kt.items() if "sm90_fwd_fp8_prepare" in name)
        main_ms = sum(ms for name, ms in kt.items() if "sm90_fwd_fp8" in name and "prepare" not in name)
        flops = op_flops(p)
        base = times["sdpa_cudnn"].median_ms
        case = f"d{d} {'causal' if causal else 'full'} b{p.batch} s{s}"
        for impl, t in times.items():
            ms = t.median_ms
            rec = dict(case=case, head_dim=d, seqlen=s, batch=p.batch, nheads=p.nheads, causal=causal,
                       impl=impl, ms=ms, tflops=flops / ms / 1e9, ratio_cudnn=base / ms)
            note = ""
            if impl == "cuflash":
                rec.update(config=cfg16.name, source=src16)
                note = cfg16.name
            if impl == "fp8":
                rec.update(config=cfg8.name, source=src8, prepare_ms=prep, main_ms=main_ms,
                           main_tflops=flops / main_ms / 1e9 if main_ms else None)
                note = (f"{cfg8.name}; prepare {prep * 1e3:.0f} us, main {main_ms:.3f} ms "
                        f"({flops / main_ms / 1e9 if main_ms else 0:.0f} TFLOPs)")
            records.append(rec)
            print(f"{case:<24} {impl:<12} {ms:8.3f} {rec['tflops']:7.1f} {rec['ratio_cudnn']:7.2f}  {note}")
        del q, k, v, q8, k8, v8
        torch.cuda.empty_cache()

    host = {}
    if not args.no_host:
        # host time per call on a tiny problem
        q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        cudnn = sdpa("sdpa_cudnn", True)
        host = {"fp8": host_us(lambda: cuflash.flash_attn_func(q8, k8, v8, causal=True, q_descale=one,
                                                               k_descale=one, v_descale=one)),
                "fp8_no_descale": host_us(lambda: cuflash.flash_attn_func(q8, k8, v8, causal=True)),
                "cuflash": host_us(lambda: cuflash.flash_attn_func(q, k, v, causal=True)),
                "sdpa_cudnn": host_us(lambda: cudnn(q, k, v))}
        print("host us per call (1x128x4x64 causal): "
              + ", ".join(f"{name} {us:.1f}" for name, us in host.items()))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": gpu, "torch": torch.__version__, "records": records, "host_us": host},
                      fh, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
