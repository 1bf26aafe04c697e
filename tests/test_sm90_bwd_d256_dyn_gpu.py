"""sm90_bwd's head-dim-256 roles tile on the dynamic scheduler (session 20: kDynamic with kRoles) on an H100,
and the 16-byte epilogue stores (wide_epi) of test_sm90_bwd_gpu.py, compiled together (--precompile).

dynamic at head dim 256: a CTA per SM (the grid min(tiles, SMs)); after its first tile (blockIdx.x) each CTA
claims K/V-block tiles from a counter; the producer loads the next tile's K_j, V_j once every consumer thread
has released the last one's (kv_empty), behind its epilogue; the ring slots' position, the writer warp's
barrier parity (dQ staged in the Q/dO slot) and the dq_first tickets run on across tiles. Cases with more
tiles than SMs (so that CTAs take several), causal and not, s_q != s_k both ways, MHA / GQA / MQA, bf16 / fp16,
real head dims 256 and 192, with and without dq_first; dK, dV bitwise equal over repeated calls (per-tile sums
in a fixed order). Errors: the 3x gradient rule against float64, outputs poisoned (NaN) before each launch.

Run: python tests/test_sm90_bwd_d256_dyn_gpu.py --precompile [--cells CELL ...]; then
     CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q -x tests/test_sm90_bwd_d256_dyn_gpu.py
"""
import os
import sys

if __name__ == "__main__":   # --precompile: cuflash and the tests' helpers from this checkout
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import pytest  # noqa: E402

from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402

from test_sm90_bwd_d256_gpu import precompile_main  # noqa: E402
from test_sm90_bwd_d256_roles_gpu import assert_dkv_repeatable  # noqa: E402
from test_sm90_bwd_gpu import problem, run_case, wide_configs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

# (head dim, dtype, causal, heads, (seqlen_q, seqlen_k), batch, dq_first); tiles = K/V blocks of 64 x batch x 4 heads
CASES = [(256, "bf16", False, "mha", (2049, 2049), 2, False),     # 264 tiles
         (256, "bf16", True, "gqa", (1023, 1100), 8, False),      # 576
         (256, "bf16", True, "mha", (2049, 2049), 2, True),       # dq_first
         (256, "bf16", False, "mqa", (301, 1100), 8, False),
         (256, "bf16", True, "mha", (1100, 301), 8, False),
         (192, "fp16", True, "gqa", (1023, 1023), 4, False),
         (256, "bf16", True, "mha", (17, 17), 2, False)]          # 8 tiles: one a CTA, no claim finds one


def dyn_tile(p, dq_first=False):
    """The d256 roles tile on the dynamic scheduler for problem p, as the call runs it (for_problem keeps it)."""
    import torch

    from cuflash import registry

    if tuple(torch.cuda.get_device_capability()) != (9, 0):
        pytest.skip("sm_90 only")
    cfg = Sm90BwdConfig(64, 64, 2, 2, 256, p.dtype, p.causal, dq_writer=True, roles=True, dynamic=True,
                        dq_first=dq_first)
    run = registry.get("sm90_bwd").for_problem(cfg, p)
    assert run == cfg and run.problems() == [], (run.name, run.problems())
    return cfg


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}_{c[1]}_{'causal' if c[2] else 'full'}_{c[3]}_"
                         f"{c[4][0]}x{c[4][1]}_b{c[5]}{'_dqf' if c[6] else ''}")
def test_d256_dynamic(case):
    d, dtype, causal, heads, seqlens, batch, dq_first = case
    p = problem(dtype, causal, d, seqlens, heads, batch=batch)
    run_case(p, dyn_tile(p, dq_first))


def test_d256_dynamic_dkv_repeatable():
    """dK, dV bitwise equal over 3 calls (whichever CTA takes a tile, its sums run in one order)."""
    p = problem("bf16", True, 256, (1023, 1100), "gqa", batch=8)
    assert_dkv_repeatable(p, dyn_tile(p))


def suite_configs(cells=(), wide=True, dyn=True):
    """The kernels this file and test_sm90_bwd_gpu.py::test_wide_epilogue run (backwards and the forwards
    selection picks at their shapes), and with `cells` (tests/sm90_bwd_2k_timing.py's --cells strings) that
    script's kernels of those cases, for --precompile."""
    from cuflash import _gpu, select

    import sm90_bwd_2k_timing as timing

    fwd = lambda p: select.choose(p.replace(op="fwd"), _gpu.arch(), _gpu.name(), _gpu.max_smem())[1]  # noqa: E731
    out = []
    for d, dtype, causal, heads, seqlens, batch, dqf in CASES if dyn else ():
        p = problem(dtype, causal, d, seqlens, heads, batch=batch)
        out += [Sm90BwdConfig(64, 64, 2, 2, 256, dtype, causal, dq_writer=True, roles=True, dynamic=True,
                              dq_first=dqf), fwd(p)]
    out += wide_configs() if wide else []
    cases, names = timing.parse_cells(list(cells), ["heur"])
    for (d, dtype, s, causal), nm in zip(cases, names):
        p = timing.problem(s, causal, dtype, d)
        out += list(timing.variants_for(p, nm).values()) + [fwd(p)]
    return list(dict.fromkeys(out))


def precompile_cli(argv) -> int:
    """--precompile [--no-wide] [--no-dyn] [--cells CELL ...]: compile suite_configs in parallel worker processes."""
    cells = argv[argv.index("--cells") + 1:] if "--cells" in argv else []
    return precompile_main(suite_configs(cells, "--no-wide" not in argv, "--no-dyn" not in argv), forwards=False)


if __name__ == "__main__" and "--precompile" in sys.argv:
    sys.exit(precompile_cli(sys.argv))
