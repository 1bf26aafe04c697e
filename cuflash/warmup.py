"""python -m cuflash warmup: compile, ahead of the first call, the kernels this GPU will run.

For every (op, dtype, head dim, causal, seqlen bucket) asked for, the config that selection
picks on this GPU (tuned entry or heuristic) is compiled in parallel worker processes into
CuPy's disk cache; later processes then load kernels instead of compiling them.
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


def configs_to_warm(ops, dtypes, head_dims, causals, device: int = 0) -> list:
    """The distinct configs selection picks for these classes, over all seqlen buckets."""
    from .select import choose_on_device

    out = []
    for op in ops:
        for dtype in dtypes:
            for d in head_dims:
                for causal in causals:
                    for s in SEQLEN_BUCKETS:
                        problem = Problem(op, dtype, 1, s, s, 1, 1, d, causal)
                        _, cfg, _ = choose_on_device(problem, device)
                        out.append(cfg)
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
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    _gpu.require("python -m cuflash warmup")
    from .compile import precompile

    ops = [o for o in args.op.split(",") if o]
    for op in ops:
        if op not in OPS:
            parser.error(f"--op: unknown op {op!r}; ops: {', '.join(OPS)}")
    dims = _ints(args.hdim) or sorted(set(tuned_head_dims(args.device)) | {64, 128})
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    configs = configs_to_warm(ops, args.dtype.split(","), dims, causals, args.device)
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
          f"(ops {','.join(ops)}, head dims {','.join(map(str, dims))})")
    precompile(configs, args.device, args.processes, progress=progress)
    sys.stderr.write("\n")
    for cfg, error in failed:
        print(f"  FAILED {cfg.name}: {error}")
    print(f"{len(configs) - len(failed)}/{len(configs)} kernels in the cache, {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0
