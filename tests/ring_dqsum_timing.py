"""One GPU, no process group: the backward calls of a non-causal ring's P steps on one rank (its
local q against P K/V blocks, the global out and lse given), with dQ summed the two ways of
cuflash.distributed.DQ_IN_WORKSPACE: "plain" (every call its own workspace and dq, dq added into
an fp32 accumulator, rounded at the end) and "ws" (_DqSum: one workspace, the main kernel alone
after the first call, one convert at the end). Not a test: times (CUDA events, one warm-up, the
two alternated, median of --reps) and the peak memory above the inputs, in units of X = one local
bf16 q-sized tensor; plus the largest difference between the two dq.

    python tests/ring_dqsum_timing.py [--local 65536] [--steps 4] [--heads 8] [--reps 5]
"""
import argparse
import json
import os
import statistics
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_here)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--local", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    from cuflash import distributed as cfd

    n, h, d = a.local, a.heads, 128
    X = n * h * d * 2
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    q, dout, out = (torch.randn(1, n, h, d, device="cuda", dtype=bf, generator=g) for _ in range(3))
    blocks = [tuple(torch.randn(1, n, h, d, device="cuda", dtype=bf, generator=g) for _ in range(2))
              for _ in range(a.steps)]
    # lse of the whole ring's keys: every score is below it (no overflow in exp(S - lse))
    lse = torch.full((1, h, n), 12.0, device="cuda") + torch.rand(1, h, n, device="cuda",
                                                                  generator=g)
    scale = d ** -0.5

    def plain():
        acc = None
        grads = []
        for k, v in blocks:
            dq_b, dk_b, dv_b = cfd.block_backward(dout, q, k, v, out, lse, scale, False, False)
            if acc is None:
                acc = dq_b.to(torch.float32)
            else:
                acc += dq_b
            grads.append((dk_b, dv_b))
            del dq_b
        return acc.to(bf), grads

    def ws():
        sums = cfd._DqSum(q, scale, True)
        grads = [sums.block(dout, q, k, v, out, lse, False, False, slice(0, n), True)
                 for k, v in blocks]
        assert sums.ws is not None
        return sums.result(), grads

    fns = {"plain": plain, "ws": ws}
    times = {name: [] for name in fns}
    peaks = {}
    results = {}
    for name, fn in fns.items():  # warm-up (compiles, plans)
        results[name] = fn()[0]
    for rep in range(a.reps):
        for name in (("plain", "ws") if rep % 2 == 0 else ("ws", "plain")):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            res = fns[name]()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
            peaks[name] = (torch.cuda.max_memory_allocated() - before) / X
            del res
    diff = (results["plain"].float() - results["ws"].float()).abs().max().item()
    rec = {"device": torch.cuda.get_device_name(), "local": n, "heads": h, "steps": a.steps,
           "reps": a.reps, "X_bytes": X, "dq_max_abs_diff": diff,
           "dq_max_abs": results["plain"].float().abs().max().item()}
    for name in fns:
        rec[f"{name}_ms"] = statistics.median(times[name])
        rec[f"{name}_ms_all"] = [round(t, 2) for t in times[name]]
        rec[f"{name}_peak_X"] = round(peaks[name], 3)
    print(json.dumps(rec), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
