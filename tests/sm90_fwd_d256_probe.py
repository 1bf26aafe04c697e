"""Where the d256 non-causal 2k forward cell loses its last percent to SDPA cuDNN (issue 11; H100):
for each row (sm90_fwd configs of the cell, SDPA cuDNN) three views, not a test:

1. bench regime: samples of --b2b back-to-back calls, interleaved in shuffled rounds (cuflash.timing), x cuDNN;
2. kernels alone: torch.profiler (CUPTI) over --prof-calls back-to-back calls per row: each kernel's
   device time, grid / block / registers / shared memory, and the call period (first start to last end
   / calls), so period - kernel time is the gap between launches;
3. clocks and power: each row run alone for --sustain-ms, NVML sampled every ~5 ms (SM clock MHz,
   power W, averages over the run's second half).

    timeout 80 python tests/sm90_fwd_d256_probe.py --out /tmp/fwd11_probe.json
    python tests/sm90_fwd_d256_probe.py --ncu    # one call of the heuristic and of cuDNN, for ncu:
    ncu --profile-from-start off --section LaunchStats --section SpeedOfLight python ... --ncu

Rows: --rows key=change,... where change is a comma-free ';'-joined list of field:value on the
heuristic's config (e.g. bn64=BN:64;tma_store:0), or a key of tests/sm90_fwd_cells_timing.CANDIDATES.
"""
import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_change(text):
    from sm90_fwd_cells_timing import CANDIDATES

    if text in CANDIDATES:
        return CANDIDATES[text]
    out = {}
    for item in filter(None, text.split(";")):
        k, v = item.split(":")
        out[k] = int(v)
        if k in ("pingpong", "persistent", "dynamic", "tma_store", "stream_tail", "tile_overlap",
                 "q_double", "tree_max", "rescale_first"):
            out[k] = bool(int(v))
    return out


def configs(dtype, d, s, causal, rows):
    from cuflash import registry
    from cuflash.problem import Problem

    fam = registry.get("sm90_fwd")
    problem = Problem.fa_convention("fwd", dtype, d, causal, s)
    heur = fam.for_problem(fam.heuristic(problem), problem)
    out = {}
    for key, change in rows:
        cfg = heur if change is None else heur.replace(**change)
        why = cfg.problems(227 * 1024)
        if why:
            print(f"  skipped {key} {cfg.name}: {'; '.join(why)}", flush=True)
            continue
        out[key] = cfg
    return problem, out


class NvmlSampler:
    """SM clock (MHz) and power (W) every ~5 ms in a thread, through NVML (pynvml) if present."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
        except Exception as exc:  # noqa: BLE001
            print(f"no NVML ({exc}): clock / power through nvidia-smi (~30 ms a sample)", flush=True)
            self.nv = None

    def read(self):
        """(SM clock MHz, power W) now."""
        if self.nv is not None:
            return (self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM),
                    self.nv.nvmlDeviceGetPowerUsage(self.h) / 1000.0)
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=2).stdout
        clk, pw = out.strip().splitlines()[0].split(",")
        return float(clk), float(pw)

    def run(self, fn, ms):
        """Calls fn() for ms milliseconds (queued in chunks), sampling; returns (clock, power) means of
        the second half."""
        import torch

        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    clk, pw = self.read()
                    samples.append((t, clk, pw))
                except Exception:  # noqa: BLE001
                    pass
                time.sleep(0.005)

        th = threading.Thread(target=sample)
        th.start()
        t0 = time.perf_counter()
        calls = 0
        while (time.perf_counter() - t0) * 1000 < ms:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        stop.set()
        th.join()
        half = [x for x in samples if x[0] >= (t0 + t1) / 2]
        if not half:
            return dict(calls=calls, ms_per_call=(t1 - t0) * 1000 / calls)
        return dict(calls=calls, ms_per_call=(t1 - t0) * 1000 / calls,
                    sm_mhz=statistics.mean(x[1] for x in half), power_w=statistics.mean(x[2] for x in half),
                    sm_mhz_min=min(x[1] for x in half), power_w_max=max(x[2] for x in half))


def profile_rows(fns, calls):
    """{row: kernel rows and call period} from one torch.profiler run per row."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for key, fn in fns.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        evs.sort(key=lambda e: e.time_range.start)
        if not evs:   # (the averages, as tests/fp8_timing.py reads them)
            avg = {e.key[:160]: getattr(e, "device_time_total", 0) / calls for e in prof.key_averages()}
            out[key] = dict(error="no kernel events", kernels={k: dict(count=calls, median_us=v)
                                                                for k, v in avg.items() if v})
            continue
        kernels = {}
        for e in evs:
            k = kernels.setdefault(e.name, dict(count=0, us=[]))
            k["count"] += 1
            k["us"].append(e.time_range.end - e.time_range.start)
        span = evs[-1].time_range.end - evs[0].time_range.start
        busy = sum(e.time_range.end - e.time_range.start for e in evs)
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(evs, evs[1:])]
        out[key] = dict(period_us=span / calls, kernel_us=busy / calls,
                        gap_us_median=statistics.median(gaps) if gaps else 0.0,
                        kernels={n[:160]: dict(count=k["count"], median_us=statistics.median(k["us"]))
                                 for n, k in kernels.items()})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--hdim", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rows", default="heur")
    ap.add_argument("--fp16-rows", default="heur")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--b2b", type=int, default=10)
    ap.add_argument("--prof-calls", type=int, default=20)
    ap.add_argument("--sustain-ms", type=float, default=300)
    ap.add_argument("--ncu", action="store_true", help="warm up, then one call per row between cudaProfilerStart / Stop")
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    def rows_of(text):
        out = []
        for item in filter(None, text.split(",")):
            key, _, change = item.partition("=")
            out.append((key, None if key == "heur" and not change else parse_change(change or key)))
        return out

    cells = [(dt, rows_of(args.rows if dt == "bf16" else args.fp16_rows)) for dt in args.dtype.split(",")]
    t0 = time.time()
    from cuflash.compile import precompile

    kernels = []
    for dt, rows in cells:
        kernels += [c.replace(section=0) for c in configs(dt, args.hdim, args.seqlen, args.causal, rows)[1].values()]
    failed = [(c.name, e[-1500:]) for c, _, e in precompile(kernels) if e]
    print(f"compiled {len(kernels)} kernels in {time.time() - t0:.0f} s", flush=True)
    assert not failed, failed
    if args.precompile_only:
        return

    import torch

    from cuflash.registry import op_flops
    from sm90_fwd_cells_timing import cell_calls, write_rows
    from cuflash.timing import time_interleaved

    sampler = None if args.ncu else NvmlSampler()
    results = []
    for dtype, rows in cells:
        problem, cfgs = configs(dtype, args.hdim, args.seqlen, args.causal, rows)
        d, s, causal = args.hdim, args.seqlen, args.causal
        fns, cudnn = cell_calls(problem, cfgs)
        cell = f"{dtype} d{d} s{s} {'causal' if causal else 'full'}"
        ref = cudnn().transpose(1, 2)                      # (batch, seqlen, heads, d), as cuflash's
        for key, fn in fns.items():
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 2e-2 and not out.isnan().any(), f"{cell} {key}: differs from cuDNN by {err:.3g}"
        fns["sdpa_cudnn"] = cudnn
        if args.ncu:
            for fn in fns.values():
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for key in ("heur", "sdpa_cudnn"):
                fns[key]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"ncu window: {cell} heur {cfgs['heur'].name}, sdpa_cudnn", flush=True)
            continue
        torch.cuda.synchronize()
        times = time_interleaved(fns, reps=args.reps, back_to_back=args.b2b, order="shuffle")
        flops = op_flops(problem)
        base = times["sdpa_cudnn"].median_ms
        try:
            prof = profile_rows(fns, args.prof_calls)
        except Exception as exc:  # noqa: BLE001 - the other views still count
            print(f"profiler failed: {exc!r}", flush=True)
            prof = {}
        sus = {key: sampler.run(fn, args.sustain_ms) for key, fn in fns.items()}
        # the sustained runs once more in the reverse order (the clock depends on what ran before)
        sus2 = {key: sampler.run(fns[key], args.sustain_ms) for key in reversed(list(fns))}
        for key, t in times.items():
            name = cfgs[key].name if key in cfgs else ""
            p = prof.get(key, {})
            row = dict(cell=cell, row=key, config=name, median_ms=t.median_ms, tflops=flops / t.median_ms / 1e9,
                       x_cudnn=base / t.median_ms, spread=t.spread, prof=p, sustain=sus[key], sustain_rev=sus2[key])
            results.append(row)
            print(f"{cell} {key:<10} {name:<60} {t.median_ms:8.4f} ms {row['tflops']:6.1f} TF "
                  f"{row['x_cudnn']:6.3f}x  kernel {p.get('kernel_us', 0):7.1f} us period {p.get('period_us', 0):7.1f} "
                  f"gap {p.get('gap_us_median', 0):5.1f}  sustain {sus[key].get('ms_per_call', 0):.4f} ms "
                  f"{sus[key].get('sm_mhz', 0):.0f} MHz {sus[key].get('power_w', 0):.0f} W | rev "
                  f"{sus2[key].get('ms_per_call', 0):.4f} ms {sus2[key].get('sm_mhz', 0):.0f} MHz "
                  f"{sus2[key].get('power_w', 0):.0f} W", flush=True)
            for kn, kv in p.get("kernels", {}).items():
                print(f"    {kv['count']:3d} x {kv['median_us']:8.1f} us  {kn}", flush=True)
        del fns, cudnn, ref
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        write_rows(args.out, results)


if __name__ == "__main__":
    main()
