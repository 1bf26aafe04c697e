"""--mode fwd: the forward of every registered fwd family against SDPA flash and cuDNN.

For each problem of the convention (head dims 64 / 128 / 256, causal and not, seqlen 512 ..
16k, bf16 unless told otherwise): every family of op ``fwd`` that runs it on this GPU,
forced through ``config=`` with the config selection gives that family (tuned for this
GPU, else its heuristic), and SDPA's flash and cuDNN backends, timed interleaved in one
process on the same tensors. Writes results/<gpu>/bench_fwd.{json,csv,png}; records:
impl, op, dtype, hdim, causal, batch, seqlen, nheads, ms, tflops, spread (family, config,
source for cuflash impls; error where an impl refused); prints the TFLOPs ratio tables.

--fp8: also the FP8 (e4m3) families (Family.dtypes "e4m3": sm90_fwd_fp8) on the same problems,
timed in the same interleaved rounds: impl "cuflash:<family>" with inputs "e4m3", on the bf16
row, so the ratio tables give FP8 over cuDNN bf16 directly. Inputs are the bf16 tensors
rounded to e4m3, per-tensor descales 1; the time is the whole call: the family's prepare kernel
(V transposed into the workspace, descales expanded) and its main kernel (cuflash.fp8).
"""
from __future__ import annotations

from .. import _gpu
from .common import (HDIMS, SEQLENS, compare_op, inputs, line, problems, ratio_tables, release,
                     results_dir, write)

STEM = "bench_fwd"


def fp8_callables(problem, tensors) -> dict:
    """{impl: (callable, record fields)} of every e4m3 fwd family that runs ``problem`` (as
    e4m3) here: the forward on ``tensors`` rounded to float8_e4m3fn, descales 1."""
    import torch

    from ..api import flash_attn_func
    from ..registry import families
    from ..select import choose

    p8 = problem.replace(dtype="e4m3")
    arch, name, smem = _gpu.arch(), _gpu.name(), _gpu.max_smem()
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in tensors[:3])
    one = torch.ones(1, device=q8.device)
    out = {}
    for fam in families("fwd", "e4m3"):
        if fam.supports(arch, p8):
            continue
        _, cfg, source = choose(p8, arch, name, smem, family=fam)
        fn = (lambda c: lambda: flash_attn_func(q8, k8, v8, causal=problem.causal, config=c,
                                                q_descale=one, k_descale=one, v_descale=one))(cfg)
        out[f"cuflash:{fam.name}"] = (fn, dict(family=fam.name, config=cfg.name, source=source,
                                               inputs="e4m3"))
    return out


def run(hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), causals=(False, True), out="results",
        reps=20, flush_l2=False, log=print, fp8=False) -> list:
    _gpu.require("bench --mode fwd")
    records = []
    for p in problems("fwd", dtypes, hdims, causals, seqlens):
        tensors = inputs(p, 3)
        extra = fp8_callables(p, tensors) if fp8 else None
        recs = compare_op(p, tensors, reps, flush_l2, log, extra=extra)
        records += recs
        log(line(p, recs, "tflops"))
        del tensors
        release()
    write(records, results_dir(out), STEM, dict(metrics="tflops", ylabel="fwd TFLOPs/s"), log)
    log("\n" + ratio_tables(records, "tflops"))
    return records
