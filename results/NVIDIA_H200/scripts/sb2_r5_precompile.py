"""Session 31 sb2 round 5: the kernels of the final check, compiled in parallel processes (CuPy's disk cache):
tests/test_short_seq_gpu.py (all), tests/short_seq_sanitize.py --s31, and the heuristic grid tests of sm90_fwd at
head dims 40 / 64 and sm90_bwd at head dim 64 (tests/test_flash_{fwd,bwd}_gpu.py test_heuristic_on_the_grid)."""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [os.path.join(root, "tests"), root]

import pytest  # noqa: E402

import short_seq_sanitize  # noqa: E402
import test_short_seq_gpu  # noqa: E402
from conftest import GPU_DTYPES, GPU_HEADS, GPU_SEQLENS, device_heuristic, grid_problem  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.compile import precompile  # noqa: E402

todo = test_short_seq_gpu.configs() + short_seq_sanitize.s31_configs()
for op, hdims in (("fwd", (40, 64)), ("bwd", (64,))):
    fam = registry.get(f"sm90_{op}")
    for dtype in GPU_DTYPES:
        for causal in (False, True):
            for hdim in hdims:
                for seqlens in GPU_SEQLENS:
                    for heads in GPU_HEADS:
                        try:
                            todo.append(device_heuristic(fam, grid_problem(op, dtype, causal, hdim, seqlens, heads)))
                        except pytest.skip.Exception:
                            pass
todo = list(dict.fromkeys(todo))
errors = [(c.name, e) for c, _, e in precompile(todo) if e]
print(len(todo), "kernels", errors[:3], flush=True)
