"""Fill CuPy's kernel cache for everything the GPU tests compile, in parallel worker
processes (not a test; run it first, then pytest finds every kernel on disk).

    CUPY_CACHE_DIR=... python tests/gpu_precompile.py [--no-space] [--fp8-only] [--processes N]

What the GPU suite uses, read from the registry and conftest's grids:
  * every family's heuristic for each (dtype, mask, head dim) of the grid, plain and
    deterministic (the backward test grid, deterministic and CuPy tests);
  * every valid point of every family's space at the space test's head dims;
  * what selection picks without a config= on this GPU (the tuned table's entries for the
    grid's sequence-length buckets), plain and deterministic;
  * gpu_sanitize.py's variants (the other key-group layouts).
"""
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # conftest; cuflash from the checkout

from cuflash import _gpu, registry, select  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

from conftest import GPU_DTYPES, GPU_HDIMS, GPU_HEADS, GPU_SEQLENS, space_configs  # noqa: E402

EXTRA_HDIMS = (72, 96, 128, 256, 160, 40, 64)  # gpu_sanitize.py, the CuPy/NumPy tests


def configs_for_suite(space=True):
    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    configs = []
    hdims = sorted(set(GPU_HDIMS) | set(EXTRA_HDIMS))
    seqlens = sorted({max(s) for s in GPU_SEQLENS} | {1100, 512, 640, 333})
    for op in ("fwd", "bwd"):
        for dtype in GPU_DTYPES:
            for causal in (False, True):
                for det in (False, True):
                    for d in hdims:
                        p = Problem(op, dtype, 1, 1024, 1024, 4, 2, d, causal, det)
                        for fam in registry.families(op):
                            if fam.supports(arch, p):
                                continue
                            cfg = fam.for_problem(fam.heuristic(p, arch, smem), p)
                            configs.append(cfg)
                            if op == "bwd" and "qsplit" in fam.space and not det:
                                for q in fam.space["qsplit"]:
                                    for w in (cfg.warps,) + tuple(fam.space.get("warps", ())):
                                        alt = cfg.replace(qsplit=q, warps=w)
                                        if not alt.problems(smem):
                                            configs.append(alt)
                                            break
                        for s in seqlens:  # the default choice, tuned or heuristic
                            try:
                                _, cfg, _ = select.choose(p.replace(seqlen_q=s, seqlen_k=s), arch,
                                                          name, smem)
                                configs.append(cfg)
                            except ValueError:
                                pass
    if space:
        configs += [cfg for _, cfg in space_configs("fwd") + space_configs("bwd")
                    if not cfg.problems(smem)]
    return list(dict.fromkeys(configs))


def fp8_configs():
    """The FP8 (e4m3) families' kernels of tests/test_fp8_gpu.py and gpu_sanitize.py: the
    heuristic per head dim and mask, and the layout variants of test_layout_variants."""
    arch, smem = _gpu.arch(), _gpu.max_smem()
    out = []
    for fam in registry.families("fwd", "e4m3"):
        for d in (64, 128, 256):
            for causal in (False, True):
                p = Problem("fwd", "e4m3", 1, 1024, 1024, 4, 2, d, causal)
                if fam.supports(arch, p):
                    continue
                cfg = fam.heuristic(p, arch, smem)
                out.append(cfg)
                if causal and d in (64, 256):
                    for change in ({"persistent": True}, {"BM": 64, "consumers": 1, "pingpong": False},
                                   {"stages": 3}, {"pingpong": False}):
                        alt = cfg.replace(**change)
                        if not alt.problems(smem):
                            out.append(alt)
    return out


def main():
    _gpu.require("tests/gpu_precompile.py")
    processes = None
    if "--processes" in sys.argv:
        processes = int(sys.argv[sys.argv.index("--processes") + 1])
    # --fp8-only: just the FP8 families' kernels (tests/test_fp8_gpu.py)
    configs = [] if "--fp8-only" in sys.argv else configs_for_suite(space="--no-space" not in sys.argv)
    configs = list(dict.fromkeys(configs + fp8_configs()))
    print(f"precompiling {len(configs)} configs ({len(GPU_HEADS)} head layouts share them)", flush=True)
    start = time.perf_counter()

    def progress(done, total, result):
        if done % 25 == 0 or done == total:
            print(f"  {done}/{total} ({time.perf_counter() - start:.0f} s)", flush=True)

    results = precompile(configs, processes=processes, progress=progress)
    errors = [(c.name, e) for c, _, e in results if e]
    slowest = max(results, key=lambda r: r[1])
    print(f"precompiled {len(results)} kernels in {time.perf_counter() - start:.1f} s "
          f"(slowest {slowest[0].name}: {slowest[1]:.1f} s)")
    for cname, e in errors:
        print(f"  FAILED {cname}: {e[:2000]}")
    return 1 if errors else 0


if __name__ == "__main__":  # spawned workers re-import this file: only the parent compiles
    sys.exit(main())
