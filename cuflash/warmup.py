"""python -m cuflash warmup: compile, ahead of the first call, the kernels this GPU will run.

For every (op, dtype, head dim, causal, seqlen bucket) asked for, the config that selection
picks on this GPU (tuned entry or heuristic) is compiled in parallel worker processes into
CuPy's disk cache; later processes then load kernels instead of compiling them.

``--features`` adds the feature calls' kernels (their flags are template parameters, so each
feature compiles its own): window, softcap, ALiBi, dropout and varlen, each alone, forward and
backward as --op asks, with representative run-time values where the config depends on them
(``feature_problems``): a first call with a feature then loads its kernels as the plain call does
(without: 1.4-1.7 s of NVRTC in its first call, H100, bench --mode startup, session 25).
"""
from __future__ import annotations

import argparse
import sys
import time

from . import _gpu
from .problem import SEQLEN_BUCKETS, Problem
from .registry import OPS


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


FEATURES = ("window", "softcap", "alibi", "dropout", "varlen")
# Representative run-time values of the features whose config depends on them: the window's bounds
# (which tiles keep keys: for_bounds) and the softcap (whether the cap allows the fixed row max).
WINDOW = 1024               # keys on each side that has a bound ((1024, 0) causal); bench --mode features'
SOFTCAPS = (30.0, 50.0)     # this project's benches; Gemma 2's attention cap
DROPOUT_P = 0.1


def feature_problems(op: str, dtype: str, head_dim: int, causal: bool, feature: str, seqlen: int) -> list:
    """The problems whose configs a first call with ``feature`` alone compiles, at one seqlen
    (batch and heads 1: the choice does not read them); [] where the call is the plain one (a
    window over every key)."""
    from .varlen import problem_of

    base = Problem(op, dtype, 1, seqlen, seqlen, 1, 1, head_dim, causal)
    if feature == "window":
        return [] if seqlen - 1 <= WINDOW else \
            [base.replace(features=("window",), window=(WINDOW, 0 if causal else WINDOW))]
    if feature == "softcap":
        return [base.replace(features=("softcap",), softcap=c) for c in SOFTCAPS]
    if feature == "alibi":
        return [base.replace(features=("alibi",))]
    if feature == "dropout":
        return [base.replace(features=("dropout",), dropout_p=DROPOUT_P)]
    if feature == "varlen":
        return [problem_of(op, dtype, 1, seqlen, seqlen, 1, 1, head_dim, causal)]
    raise ValueError(f"features: unknown feature {feature!r}; features: {', '.join(FEATURES)}")


def configs_to_warm(ops, dtypes, head_dims, causals, device: int = 0, features=()) -> list:
    """The distinct configs selection picks for these classes, over all seqlen buckets; with
    ``features``, also those of each feature's calls (as their plans compile them: the choice,
    then the call's bounds, ``Family.for_bounds``); a feature no family runs for a class is
    skipped."""
    from .select import UnsupportedProblem, choose_on_device

    out = []
    for op in ops:
        for dtype in dtypes:
            for d in head_dims:
                for causal in causals:
                    for s in SEQLEN_BUCKETS:
                        problem = Problem(op, dtype, 1, s, s, 1, 1, d, causal)
                        _, cfg, _ = choose_on_device(problem, device)
                        out.append(cfg)
                        for feature in features:
                            for fp in feature_problems(op, dtype, d, causal, feature, s):
                                try:
                                    family, cfg, _ = choose_on_device(fp, device)
                                except UnsupportedProblem:
                                    continue
                                out.append(family.for_bounds(cfg, fp))
    return list(dict.fromkeys(out))


def tuned_head_dims(device: int = 0) -> list[int]:
    """Head dims that this GPU's tuned tables hold entries for."""
    from .select import files_for_gpu

    dims = {e.head_dim for tf in files_for_gpu(_gpu.name(device), _gpu.arch(device)) for e in tf.entries}
    return sorted(dims)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash warmup", description=__doc__.split("\n")[0])
    parser.add_argument("--op", default="fwd,bwd", help="ops to warm (default fwd,bwd)")
    parser.add_argument("--dtype", default="bf16,fp16")
    parser.add_argument("--hdim", default="", help="head dims (default: this GPU's tuned ones, and 64,128)")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--features", default="",
                        help=f"also the feature calls' kernels: a comma list of {','.join(FEATURES)}, "
                             "or all (default none)")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    features = FEATURES if args.features == "all" else [f for f in args.features.split(",") if f]
    for f in features:
        if f not in FEATURES:
            parser.error(f"--features: unknown feature {f!r}; features: {', '.join(FEATURES)}, all")
    _gpu.require("python -m cuflash warmup")
    from .compile import precompile

    ops = [o for o in args.op.split(",") if o]
    for op in ops:
        if op not in OPS:
            parser.error(f"--op: unknown op {op!r}; ops: {', '.join(OPS)}")
    dims = _ints(args.hdim) or sorted(set(tuned_head_dims(args.device)) | {64, 128})
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    configs = configs_to_warm(ops, args.dtype.split(","), dims, causals, args.device, features)
    start = time.perf_counter()
    failed = []

    def progress(done, total, result):
        cfg, seconds, error = result
        if error:
            failed.append((cfg, error))
        width = 30
        bar = "#" * (width * done // total) + "." * (width - width * done // total)
        sys.stderr.write(f"\r[{bar}] {done}/{total} {cfg.name[:48]:<48} {seconds:5.1f} s")
        sys.stderr.flush()

    print(f"warming {len(configs)} kernels on {_gpu.name(args.device)} "
          f"(ops {','.join(ops)}, head dims {','.join(map(str, dims))}"
          + (f", features {','.join(features)})" if features else ")"))
    precompile(configs, args.device, args.processes, progress=progress)
    sys.stderr.write("\n")
    for cfg, error in failed:
        print(f"  FAILED {cfg.name}: {error}")
    print(f"{len(configs) - len(failed)}/{len(configs)} kernels in the cache, {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0
