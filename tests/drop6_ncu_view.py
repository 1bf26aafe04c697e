"""The d128 8k causal forward and backward main kernels with and without dropout (and the dropout
forms under test) once each inside cudaProfilerStart/Stop, for ncu's per-kernel view (issue
activity, pipe utilization, instruction counts); not a test:

    ncu --profile-from-start off --kernel-name regex:sm90_ --section ComputeWorkloadAnalysis \\
        --section InstructionStats --section SchedulerStats --csv --page raw \\
        python tests/drop6_ncu_view.py > ncu.csv
    python tests/drop6_ncu_view.py --summarize ncu.csv    # the columns that matter, one block per kernel
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.select import choose_on_device  # noqa: E402

P = 0.1


def main():
    b, s, h, d, causal = 2, 8192, 16, 128, True
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    drop = Problem("fwd", "bf16", b, s, s, h, h, d, causal, features=("dropout",), dropout_p=P)
    bcfg = choose_on_device(drop.replace(op="bwd"), 0)[1]
    bwd = registry.get("sm90_bwd")
    calls = [("plain", {}, None), ("dropout", {}, P)]
    calls += [(f"dpk{f}", dict(bwd_config=bwd.for_problem(bcfg.replace(drop_packed=f), drop.replace(op="bwd"))), P)
              for f in (1, 2)]
    for name, kw, p in calls:   # compile and warm up outside the profiled range
        out = cuflash.flash_attn_func(q, k, v, p or 0.0, causal=causal, **kw)
        torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    for name, kw, p in calls:
        print("call", name, kw, flush=True)
        out = cuflash.flash_attn_func(q, k, v, p or 0.0, causal=causal, **kw)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        if name.startswith("dpk"):   # the backward's variants: only the backward profiled
            torch.autograd.grad(out, (q, k, v), dout)
        else:
            out2 = cuflash.flash_attn_func(q, k, v, p or 0.0, causal=causal, **kw)
            torch.autograd.grad(out2, (q, k, v), dout)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


SUMMARY_KEYS = ("Kernel Name", "gpu__time_duration.sum", "smsp__issue_active.avg.pct", "sm__inst_executed.sum",
                "smsp__inst_executed.avg.per_cycle_active", "pipe_tensor", "pipe_fma", "pipe_alu", "pipe_xu",
                "pipe_fmaheavy", "pipe_fp16", "smsp__average_warp", "smsp__warps_eligible")


def summarize(path, keys=SUMMARY_KEYS):
    """An ncu --page raw --csv export: the columns whose names contain one of ``keys``, one block per kernel."""
    import csv

    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    hdr = rows[0]
    want = [i for i, col in enumerate(hdr) if any(k in col for k in keys)]
    for r in rows[2:]:
        print("----")
        for i in want:
            if i < len(r) and r[i]:
                print(f"{hdr[i]} = {r[i][:90]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2])
    else:
        main()
