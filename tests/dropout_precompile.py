"""Fill CuPy's kernel cache with the dropout kernels that the dropout GPU tests compile
(test_dropout_gpu.py, test_sm90_dropout_gpu.py, test_sm90_bwd_features_gpu.py's dropout tests,
test_dropmix_gpu.py), in parallel worker processes; not a test. Run it first:

    CUPY_CACHE_DIR=... timeout 300 python tests/dropout_precompile.py

What it compiles: for bf16 (head dims 64 / 96 / 128 / 256) and fp16 (64 / 128, and 96 without
causal), both masks: selection's dropout forward and backward on this GPU, every family's
dropout heuristic (sm90_fwd also persistent), and the bf16 d128 dropout mixes (window,
softcap, ALiBi, all).
"""
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

from cuflash import _gpu, registry  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.select import choose_on_device  # noqa: E402

MIXES = [("dropout", "window"), ("dropout", "softcap"), ("alibi", "dropout"),
         ("alibi", "dropout", "softcap", "window")]


def configs():
    arch, smem = _gpu.arch(0), _gpu.max_smem(0)
    out = []
    for dtype, d, causal in itertools.product(("bf16", "fp16"), (64, 96, 128, 256), (False, True)):
        for op in ("fwd", "bwd"):
            feats = [("dropout",)] + (MIXES if d == 128 and dtype == "bf16" else [])
            if dtype == "fp16" and (d == 256 or (d == 96 and causal)):
                continue
            for f in feats:
                p = Problem(op, dtype, 2, 1000, 1000, 4, 2, d, causal, features=f, dropout_p=0.17)
                out.append(choose_on_device(p, 0)[1])
                for fam in registry.families(op):
                    if fam.name.endswith("fp8") or fam.name.endswith("paged") or fam.supports(arch, p):
                        continue
                    cfg = fam.for_problem(fam.heuristic(p, arch, smem), p)
                    out.append(cfg)
                    if fam.name == "sm90_fwd":
                        out.append(cfg.replace(persistent=True))
    return list(dict.fromkeys(out))


def main():
    todo = configs()
    t0 = time.time()
    errors = [r for r in precompile(todo, 0, processes=min(16, os.cpu_count() or 1)) if r[2]]
    print(f"{len(todo)} kernels in {time.time() - t0:.0f} s; errors: {len(errors)}")
    for cfg, _, err in errors:
        print(f"  {cfg.name}: {err[:300]}")


if __name__ == "__main__":
    main()
