"""--mode tuned: each family's tuned configs against its heuristic and against SDPA.

For every op (--ops, default every registered op), problem of the convention and family
that runs it here: "tuned:<family>" (the config selection gives the family: this GPU's
tuned entry, else the heuristic) and "heuristic:<family>" (the family's heuristic for this
GPU, what a tuned entry overrides), next to SDPA flash and cuDNN, all timed interleaved on
the same tensors (the forward alone, or the backward alone on one forward's results). Where
the tuned config is the heuristic's it is one kernel, timed once, and both records carry
that time with same_config true.

Writes results/<gpu>/bench_tuned.{json,csv,png}; records: impl, op, dtype, hdim, causal,
batch, seqlen, nheads, ms, tflops, spread, family, config, source, same_config (error
where an impl refused); prints a table per family: tuned TFLOPs (tuned/heuristic /
tuned/sdpa_flash).
"""
from __future__ import annotations

from .. import _gpu
from ..registry import OPS
from .common import (HDIMS, SDPA_IMPLS, SEQLENS, family_choices, heuristic_config, inputs, line,
                     measure, op_callable, problems, ratio_table, release, results_dir, short,
                     timed_record, write)

STEM = "bench_tuned"
ROWS = ("op", "dtype", "hdim", "causal")


def measure_problem(p, tensors, reps=20, flush_l2=False, log=print) -> list:
    fns, meta, errors = {}, {}, {}
    for fam, tuned, source in family_choices(p):
        heur = heuristic_config(fam, p)
        same = tuned == heur
        for kind, cfg, src in (("tuned", tuned, source), ("heuristic", heur, "heuristic")):
            name = f"{kind}:{fam.name}"
            meta[name] = dict(family=fam.name, config=cfg.name, source=src, same_config=same)
            if kind == "heuristic" and same:
                continue  # one kernel: timed once, as tuned
            try:
                fns[name] = op_callable("cuflash", p, tensors, cfg)
            except Exception as exc:  # noqa: BLE001
                errors[name] = short(exc)
    for impl in SDPA_IMPLS:
        meta[impl] = {}
        try:
            fns[impl] = op_callable(impl, p, tensors)
        except Exception as exc:  # noqa: BLE001
            errors[impl] = short(exc)
    timings = {**measure(fns, reps, flush_l2, log), **errors}
    for name, kw in meta.items():
        if kw.get("same_config") and name.startswith("heuristic:"):
            timings[name] = timings["tuned:" + kw["family"]]
    return [timed_record(p, name, timings[name], **kw) for name, kw in meta.items()]


def tables(records: list) -> str:
    out = []
    for fam in dict.fromkeys(r["family"] for r in records if r.get("family")):
        out.append(ratio_table(records, "tflops", f"tuned:{fam}", (f"heuristic:{fam}", "sdpa_flash"),
                               ROWS, ratio_digits=3))
    return "\n\n".join(out)


def run(hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), causals=(False, True), ops=tuple(OPS),
        out="results", reps=20, flush_l2=False, log=print) -> list:
    _gpu.require("bench --mode tuned")
    records = []
    for op in ops:
        if op not in ("fwd", "bwd"):  # decode has its own shapes and mode (bench --mode decode)
            log(f"bench tuned: op {op} is benchmarked by its own mode, skipped here")
            continue
        for p in problems(op, dtypes, hdims, causals, seqlens):
            tensors = inputs(p, 4 if op == "bwd" else 3)
            recs = measure_problem(p, tensors, reps, flush_l2, log)
            records += recs
            log(line(p, recs, "tflops"))
            del tensors
            release()
    write(records, results_dir(out), STEM,
          dict(metrics="tflops", panels=ROWS, ylabel="TFLOPs/s"), log)
    log("\n" + tables(records))
    return records
