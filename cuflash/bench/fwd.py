"""--mode fwd: the forward of every registered fwd family against SDPA flash and cuDNN.

For each problem of the convention (head dims 64 / 128 / 256, causal and not, seqlen 512 ..
16k, bf16 unless told otherwise): every family of op ``fwd`` that runs it on this GPU,
forced through ``config=`` with the config selection gives that family (tuned for this
GPU, else its heuristic), and SDPA's flash and cuDNN backends, timed interleaved in one
process on the same tensors. Writes results/<gpu>/bench_fwd.{json,csv,png}; records:
impl, op, dtype, hdim, causal, batch, seqlen, nheads, ms, tflops, spread (family, config,
source for cuflash impls; error where an impl refused); prints the TFLOPs ratio tables.
"""
from __future__ import annotations

from .. import _gpu
from .common import (HDIMS, SEQLENS, compare_op, inputs, line, problems, ratio_tables, release,
                     results_dir, write)

STEM = "bench_fwd"


def run(hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), causals=(False, True), out="results",
        reps=20, flush_l2=False, log=print) -> list:
    _gpu.require("bench --mode fwd")
    records = []
    for p in problems("fwd", dtypes, hdims, causals, seqlens):
        tensors = inputs(p, 3)
        recs = compare_op(p, tensors, reps, flush_l2, log)
        records += recs
        log(line(p, recs, "tflops"))
        del tensors
        release()
    write(records, results_dir(out), STEM, dict(metrics="tflops", ylabel="fwd TFLOPs/s"), log)
    log("\n" + ratio_tables(records, "tflops"))
    return records
