"""Host time of one eager call of the feature paths (issue 12): flash_attn_func with a window, softcap,
ALiBi or dropout and flash_attn_varlen_func, forward and forward + backward, against the plain and
causal calls and SDPA's nearest call, in one process (cuflash.bench.overhead.feature_host_records:
CPU clock over calls on a tiny problem, 1 x 128 x 4 x 64 bf16, where the GPU is never the bound;
the implementations interleaved in rounds). Not a test:

    timeout 100 python tests/features_host_timing.py --precompile --profile --out $RES/host.json
    timeout 100 python tests/features_host_timing.py --precompile --eager --no-sdpa   # + one eager call each

--eager: also one eager call + synchronize per case on bench's EAGER shape (8 x 2k x 16 x 128, window
(1024, 0); overhead.feature_eager_records). --precompile: one worker process per cuflash case, pass
(and shape) first (one call each: fills CuPy's kernel cache in parallel). --profile: per cuflash case,
torch.profiler's self-CPU table and cProfile's top functions by own time over --profile-calls calls
(written under --profile-dir; the forward + backward's first lines printed). --varlen-check: the varlen
call with and without the API's read-back of cu_seqlens (cuflash.api.CHECK_CU_SEQLENS), interleaved.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_here)]  # the checkout

from cuflash.bench import overhead  # noqa: E402


def warm(case_pass: str) -> None:
    """Compile (or load) the kernels of one cuflash case and pass ('window:fwdbwd', or
    'window:fwdbwd:eager' on overhead.EAGER)."""
    case, pass_, *eager = case_pass.split(":")
    fn, sync, _ = overhead.feature_call("cuflash", case, pass_ == "fwdbwd",
                                        overhead.EAGER if eager else overhead.TINY)
    fn()
    sync()


def precompile(cases, eager=False, host=True) -> None:
    t0 = time.time()
    shapes = ("",) * host + (":eager",) * eager
    procs = {c: subprocess.Popen([sys.executable, __file__, "--warm", c], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
             for c in (f"{case}:{p}{e}" for case in cases for p in ("fwd", "fwdbwd") for e in shapes)}
    for c, p in procs.items():
        out, _ = p.communicate()
        if p.returncode:
            print(f"warm {c}: rc {p.returncode}\n{out[-1500:]}")
    print(f"precompile: {len(procs)} processes in {time.time() - t0:.0f} s", flush=True)


def profile(cases, calls: int, out_dir: str, head: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    os.makedirs(out_dir, exist_ok=True)
    for case in cases:
        for pass_ in ("fwdbwd", "fwd"):
            try:
                fn, sync, _ = overhead.feature_call("cuflash", case, pass_ == "fwdbwd")
                for _ in range(20):
                    fn()
                sync()
                with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(calls):
                        fn()
                    sync()
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
                pr = cProfile.Profile()
                sync()
                pr.enable()
                for _ in range(calls):
                    fn()
                pr.disable()
                sync()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
                text = f"== {case} {pass_}: torch.profiler over {calls} calls\n{table}\n" \
                       f"== cProfile, tottime\n{s.getvalue()}"
                with open(os.path.join(out_dir, f"profile_{case}_{pass_}.txt"), "w") as f:
                    f.write(text)
                if pass_ == "fwdbwd":
                    lines = s.getvalue().splitlines()
                    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
                    print(f"== {case} fwdbwd cProfile (per {calls} calls), top by tottime:")
                    print("\n".join(lines[start:start + head]), flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"profile {case} {pass_}: {type(exc).__name__}: {str(exc)[:300]}")
    del torch


def varlen_check(calls: int, rounds: int) -> dict:
    """Host µs per varlen call (fwd, fwdbwd) with the cu_seqlens read-back on and off."""
    from cuflash import api
    from cuflash.timing import host_us_interleaved

    res = {}
    for pass_ in ("fwd", "fwdbwd"):
        fn, sync, ctx = overhead.feature_call("cuflash", "varlen", pass_ == "fwdbwd")

        def off(fn=fn):
            api.CHECK_CU_SEQLENS = False
            try:
                fn()
            finally:
                api.CHECK_CU_SEQLENS = True

        r = host_us_interleaved({"check": (fn, ctx), "nocheck": (off, ctx)}, calls, rounds, sync)
        res[pass_] = {k: {"best": b, "median": m} for k, (b, m) in r.items()}
        print(f"varlen {pass_}: cu_seqlens checked {r['check'][1]:.1f} us, unchecked "
              f"{r['nocheck'][1]:.1f} us (median round)", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="+", default=list(overhead.FEATURE_CASES))
    ap.add_argument("--calls", type=int, default=500, help="calls per round per implementation, x5")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--round-ms", type=float, default=25.0,
                    help="fewer calls per round for a call slower than this / (calls / 5)")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--precompile-only", action="store_true", help="--precompile, then exit")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-calls", type=int, default=50)
    ap.add_argument("--profile-cases", nargs="+", help="the cases to profile (default: --cases)")
    ap.add_argument("--profile-dir", default=os.environ.get("RES", "."))
    ap.add_argument("--profile-head", type=int, default=14)
    ap.add_argument("--varlen-check", action="store_true")
    ap.add_argument("--eager", action="store_true",
                    help="also one eager call + synchronize per case on overhead.EAGER (8 x 2k x 16 x 128)")
    ap.add_argument("--eager-reps", type=int, default=10)
    ap.add_argument("--no-host", action="store_true", help="skip the host µs per call on TINY")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.warm:
        return warm(args.warm)
    if args.precompile or args.precompile_only:
        precompile(args.cases, args.eager, not args.no_host)
        if args.precompile_only:
            return None
    import torch

    print(f"{args.tag} torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    recs = []
    if not args.no_host:
        t0 = time.time()
        recs = overhead.feature_host_records(args.cases, calls=args.calls, rounds=args.rounds,
                                             sdpa=not args.no_sdpa, round_ms=args.round_ms,
                                             log=lambda line: print(line, flush=True))
        print(f"timed in {time.time() - t0:.0f} s")
        for r in recs:
            if "error" in r:
                print(f"  {r['impl']} {r['case']} {r['path']}: {r['error']}")
        print(overhead.feature_table(recs), flush=True)
    extra = {}
    if args.eager:
        t0 = time.time()
        eager = []
        for case in args.cases:   # case by case, each record printed (a timeout keeps what was done)
            for r in overhead.feature_eager_records([case], overhead.EAGER, args.eager_reps,
                                                    sdpa=not args.no_sdpa):
                eager.append(r)
                print(f"  {r['path']} {r['case']} {r['impl']}: "
                      + (r["error"] if "error" in r else f"{r['wall_ms']:.3f} ms one call, "
                         f"{r['kernel_ms']:.3f} ms back to back"), flush=True)
        print(f"eager calls timed in {time.time() - t0:.0f} s")
        print(overhead.feature_eager_table(eager), flush=True)
        recs += eager
    if args.varlen_check:
        extra["varlen_check"] = varlen_check(max(1, args.calls // 5), args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tag": args.tag, "records": recs, **extra}, f, indent=1)
    if args.profile:
        profile(args.profile_cases or args.cases, args.profile_calls, args.profile_dir,
                args.profile_head)


if __name__ == "__main__":
    main()
