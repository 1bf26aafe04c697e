"""The d128 8k forward rows of tests/drp8_timing.py (plain, dropout, and the dropout kernel's timing forms)
once each inside cudaProfilerStart/Stop, for ncu's per-kernel view; not a test:

    ncu --profile-from-start off --kernel-name regex:sm90_fwd --section WarpStateStats \\
        --section InstructionStats --section ComputeWorkloadAnalysis -f -o /tmp/drp8 \\
        python tests/drp8_ncu.py --rows plain dropout dpe3 dpe6
    ncu --import /tmp/drp8.ncu-rep --page details > details.txt
    python tests/drp8_ncu.py --summarize raw.csv     # (ncu --import ... --page raw --csv > raw.csv)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def main():
    import torch

    import cuflash
    from cuflash.families import sm90_fwd

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from drp8_timing import P, fwd_rows

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["plain", "dropout", "dpe3", "dpe6"])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--hdim", type=int, default=128)
    args = ap.parse_args()
    sm90_fwd.DROP_EARLY_TIMING = True
    b, s, d = 2, 8192, args.hdim
    h = 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]:
        rows = fwd_rows(d, causal, b, s, h, [3, 5, 6])
        for key in args.rows:
            if key not in rows:
                print("no row", key)
                continue
            cfg, _, dr = rows[key]
            run = lambda: cuflash.flash_attn_func(q, k, v, P if dr else 0.0, causal=causal, config=cfg)  # noqa: E731
            with torch.no_grad():
                run()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                run()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
            print("profiled", "causal" if causal else "full", key, cfg.name if cfg else "(selection's)", flush=True)


def summarize(path):
    """The raw page's columns that answer where the time goes: instructions by class, issue activity,
    stall reasons (per issue), pipe use; one block per kernel."""
    from drop6_ncu_view import summarize as columns

    columns(path, ("Kernel Name", "gpu__time_duration.sum", "issue_active", "inst_executed.sum", "inst_executed_pipe",
                   "smsp__average_warp", "warp_issue_stalled", "warps_eligible", "pipe_tensor", "pipe_fma",
                   "pipe_alu", "pipe_xu", "pipe_fp16", "sass_thread_inst_executed_op", "launch__registers"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2])
    else:
        main()
