"""--mode fwdbwd: the backward alone, and forward + backward, against SDPA flash and cuDNN.

For each problem of the convention: every family of op ``bwd`` that runs it on this GPU
(impl "cuflash:<family>", its config as selection gives it) and SDPA's flash and cuDNN
backends. The backward is timed alone on one forward's results: cuflash by
``flash_attn_backward(dout, q, k, v, out, lse)``, SDPA by ``torch.autograd.grad(out, (q, k, v),
dout, retain_graph=True)``. The forwards are timed too (cuflash: the default dispatch, the
forward every backward family pairs with), so fwd+bwd = fwd_ms + bwd_ms. --deterministic
adds each family's deterministic backward ("cuflash:<family>[det]").

Writes results/<gpu>/bench_fwdbwd.{json,csv,png}; records: impl, dtype, hdim, causal,
batch, seqlen, nheads, fwd_ms, fwd_tflops, bwd_ms, bwd_tflops, fwdbwd_ms, fwdbwd_tflops
(FLOPs: fwd 4·b·h·s²·d, bwd 2.5x, ÷2 causal), family / config / source / fwd_config for
cuflash, grad_rel_diff_vs_sdpa_flash (max over dq, dk, dv of max|Δ| / max|ref|: a sanity
number), error where an impl refused.
"""
from __future__ import annotations

from .. import _gpu
from ..registry import op_flops
from .common import (HDIMS, REF, SEQLENS, compare_op, inputs, line, problems, ratio_tables,
                     release, results_dir, short, write)

STEM = "bench_fwdbwd"


def grad_rel_diff(a, b) -> float:
    """max over (dq, dk, dv) of max|a - b| / max|b| (float32)."""
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.float(), y.float()
        worst = max(worst, float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30))
    return worst


def combine(fwd_recs: list, bwd_recs: list, pf, pb) -> list:
    """One record per backward impl: its bwd_* fields, the fwd_* of its forward (the same
    SDPA impl; for cuflash impls the first cuflash forward: the default dispatch's family),
    and fwd+bwd."""
    fwd = {r["impl"]: r for r in fwd_recs}
    cuflash_fwd = next((r for r in fwd_recs if r["impl"].startswith("cuflash")), {})
    out = []
    for b in bwd_recs:
        f = cuflash_fwd if b["impl"].startswith("cuflash") else fwd.get(b["impl"], {})
        rec = {k: v for k, v in b.items() if k not in ("op", "ms", "tflops", "spread", "error")}
        if b["impl"].startswith("cuflash"):
            rec["fwd_config"] = f.get("config")
        errors = list(dict.fromkeys(x for x in (f.get("error"), b.get("error")) if x))
        if errors:
            rec["error"] = "; ".join(errors)
        rec.update(fwd_ms=f.get("ms"), fwd_tflops=f.get("tflops"), bwd_ms=b.get("ms"),
                   bwd_tflops=b.get("tflops"))
        if rec["fwd_ms"] and rec["bwd_ms"]:
            ms = rec["fwd_ms"] + rec["bwd_ms"]
            rec.update(fwdbwd_ms=ms, fwdbwd_tflops=(op_flops(pf) + op_flops(pb)) / ms / 1e9)
        out.append(rec)
    return out


def grad_check(fns: dict, recs: list) -> None:
    """grad_rel_diff_vs_sdpa_flash on each record, from its backward callable in fns."""
    if REF not in fns:
        return
    ref = fns[REF]()
    for rec in recs:
        if rec["impl"] != REF and rec["impl"] in fns:
            try:
                rec["grad_rel_diff_vs_sdpa_flash"] = grad_rel_diff(fns[rec["impl"]](), ref)
            except Exception as exc:  # noqa: BLE001
                rec["grad_check_error"] = short(exc)


def run(hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), causals=(False, True), out="results",
        reps=10, flush_l2=False, deterministic=False, log=print) -> list:
    _gpu.require("bench --mode fwdbwd")
    records = []
    for pb in problems("bwd", dtypes, hdims, causals, seqlens):
        pf = pb.replace(op="fwd")
        tensors = inputs(pb, 4)
        fns = {}
        fwd_recs = compare_op(pf, tensors, reps, flush_l2, log)
        bwd_recs = compare_op(pb, tensors, reps, flush_l2, log, callables=fns)
        if deterministic:
            n = sum(r["impl"].startswith("cuflash") for r in bwd_recs)
            bwd_recs[n:n] = compare_op(pb.replace(deterministic=True), tensors, reps, flush_l2,
                                       log, sdpa_impls=(), suffix="[det]", callables=fns)
        grad_check(fns, bwd_recs)
        recs = combine(fwd_recs, bwd_recs, pf, pb)
        records += recs
        log(line(pb, recs, "bwd_tflops"))
        del tensors
        release()
    write(records, results_dir(out), STEM,
          dict(metrics=("bwd_tflops", "fwdbwd_tflops"), ylabel="TFLOPs/s"), log)
    for metric in ("bwd_tflops", "fwdbwd_tflops"):
        log("\n" + ratio_tables(records, metric))
    return records
