"""tests/sm90_fwd_cells_timing.py's rows without a GPU: every row a valid config of its cell, the
heuristic's first, no two rows the same kernel and section, a bounded compile count. CPU only."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sm90_fwd_cells_timing as t  # noqa: E402

from cuflash import registry  # noqa: E402


def test_rows_are_valid_and_distinct_with_the_heuristic_first():
    fam = registry.get("sm90_fwd")
    for dtype, d, causal, s, rows in t.cells_of(("bf16", "fp16")):
        problem, cfgs = t.cell_configs(dtype, d, causal, s, rows, quiet=True)
        assert list(cfgs)[0] == "heur"
        assert cfgs["heur"] == fam.for_problem(fam.heuristic(problem), problem)
        assert len(set(cfgs.values())) == len(cfgs)
        assert all(not c.problems(227 * 1024) for c in cfgs.values())
        assert all(c.causal == causal and c.dtype == dtype for c in cfgs.values())
    kernels = t.all_configs(("bf16", "fp16"))
    assert len({c.kernel_name() for c in kernels}) == len(kernels) <= 48
