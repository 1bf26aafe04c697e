"""Time cuflash's rotary kernel against the plain torch formula (not a test).

    python tests/rotary_timing.py [--out results.json]

Per shape: cuflash.layers.rotary.apply_rotary_emb out of place (the 16-byte-group kernel, and the
one-element kernel: cuflash.rotary.VECTORIZE off for its plans) and in place, and
apply_rotary_emb_torch (the torch formula: slices, repeats, multiplies, a concatenation), the
same inputs, in alternating rounds; each round times 20 back-to-back calls between two CUDA
events, the per-call time is the median over rounds. Also the host time per call of a decoding
shape (CPU clock over 300 calls, synchronized at the end; 7 alternating rounds, median): the
eager function (no autograd.Function without grad), the autograd.Function route it took before
(ApplyRotaryEmb.apply, the body of session 25's apply_rotary_emb), the torch op
torch.ops.cuflash.rotary (the dispatcher: what torch.compile traces), RotaryEmbedding's in-place
qkv form, and the torch formula. --host-only: the host times alone. Prints a table, writes JSON.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from cuflash import rotary as rotary_op  # noqa: E402
from cuflash.layers.rotary import (ApplyRotaryEmb, ApplyRotaryEmbQKV_, apply_rotary_emb,  # noqa: E402
                                   apply_rotary_emb_qkv_, apply_rotary_emb_torch)

SHAPES = [  # (batch, seqlen, nheads, headdim, rotary_dim, interleaved)
    (4, 4096, 32, 128, 128, False),
    (4, 4096, 32, 128, 128, True),
    (8, 2048, 16, 64, 32, False),
    (32, 1, 32, 128, 128, False),
]
CALLS, ROUNDS = 20, 15


def per_call_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / CALLS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--host-only", action="store_true")
    args = ap.parse_args()
    rows = []
    for b, s, h, d, r, il in ([] if args.host_only else SHAPES):
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(s, r // 2, device="cuda") * 6.28
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        y = x.clone()
        plans = {True: {}, False: {}}     # the plans made with and without the vector kernel

        def with_plans(vector, fn):
            def call():
                rotary_op._plans = plans[vector]
                return fn()
            return call

        for vector in (False, True):
            rotary_op.VECTORIZE = vector
            with_plans(vector, lambda: apply_rotary_emb(x, cos, sin, interleaved=il))()
        rotary_op.VECTORIZE = True
        fns = {
            "cuflash": with_plans(True, lambda: apply_rotary_emb(x, cos, sin, interleaved=il)),
            "cuflash_scalar": with_plans(False, lambda: apply_rotary_emb(x, cos, sin, interleaved=il)),
            "cuflash_inplace": with_plans(True, lambda: apply_rotary_emb(y, cos, sin, interleaved=il, inplace=True)),
            "torch_formula": with_plans(True, lambda: apply_rotary_emb_torch(x, cos, sin, interleaved=il)),
        }
        err = (apply_rotary_emb(x, cos, sin, interleaved=il).float()
               - apply_rotary_emb_torch(x.float(), cos.float(), sin.float(), interleaved=il)).abs().max().item()
        for fn in fns.values():  # warm-up: compiles, plans, allocator
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        times = {k: [] for k in fns}
        for i in range(ROUNDS):
            order = list(fns) if i % 2 == 0 else list(reversed(fns))
            for k in order:
                times[k].append(per_call_ms(fns[k]))
        med = {k: statistics.median(v) for k, v in times.items()}
        moved = 2 * x.numel() * x.element_size()   # read x, write out
        row = {"shape": [b, s, h, d], "rotary_dim": r, "interleaved": il, "max_abs_vs_fp32_formula": err,
               "ms": med, "GBps": {k: moved / (v * 1e-3) / 1e9 for k, v in med.items()},
               "speedup_vs_torch": med["torch_formula"] / med["cuflash"],
               "vector_kernel": plans[True][next(iter(plans[True]))].vector is not None}
        rows.append(row)
        print(f"{b}x{s}x{h}x{d} r{r} {'gptj' if il else 'neox'}: " + "  ".join(
            f"{k} {v * 1e3:8.1f} us ({row['GBps'][k]:6.0f} GB/s)" for k, v in med.items())
            + f"  x torch {row['speedup_vs_torch']:.2f}  err {err:.2e}", flush=True)
    # host time per call, decoding shape
    x = torch.randn(32, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(64, 64, device="cuda")
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    qkv = torch.randn(32, 1, 3, 32, 128, device="cuda", dtype=torch.bfloat16)
    fns = {"cuflash": lambda: apply_rotary_emb(x, cos, sin, seqlen_offsets=7),
           "function_apply_before": lambda: ApplyRotaryEmb.apply(x, cos, sin, False, False, 7, None, None),
           "torch_op": lambda: torch.ops.cuflash.rotary(x, cos, sin, None, 7, None, -1, False, False),
           "qkv_inplace": lambda: apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=7),
           "qkv_function_apply_before": lambda: ApplyRotaryEmbQKV_.apply(qkv, cos, sin, None, None, False, 7, None),
           "torch_formula": lambda: apply_rotary_emb_torch(x, cos[7:8], sin[7:8])}
    runs = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    for i in range(7):
        for name in (list(fns) if i % 2 == 0 else list(reversed(fns))):
            t0 = time.perf_counter()
            for _ in range(300):
                fns[name]()
            torch.cuda.synchronize()
            runs[name].append((time.perf_counter() - t0) / 300 * 1e6)
    host = {k: statistics.median(v) for k, v in runs.items()}
    print("host us per call (32x1x32x128, offset 7), median of 7 rounds of 300: "
          + "  ".join(f"{k} {v:.1f}" for k, v in host.items()))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "host_us_per_call": host, "host_us_runs": runs, "calls_per_round": CALLS, "rounds": ROUNDS}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
