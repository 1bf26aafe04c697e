"""compute-sanitizer target for sm90_bwd's head-dim-256 tile with dq_writer (dQ_i's part staged in
the Q/dO ring slot; issue 14): small forced-config calls, causal and not, with and without the
2-CTA cluster, with roles (the warpgroups split by operand, its named barriers),
several Q blocks per CTA (the ring's slots refilled) and a ragged last block. Not a test: run it
under racecheck / synccheck / memcheck.

    CUFLASH_LINEINFO=1 CUPY_CACHE_DIR=/tmp/cupy_li python tests/sm90_bwd_d256_race.py --precompile
    CUFLASH_LINEINFO=1 CUPY_CACHE_DIR=/tmp/cupy_li compute-sanitizer --tool racecheck \\
        --racecheck-report all python tests/sm90_bwd_d256_race.py [--only _rol]

--only SUBSTR keeps the cases whose config name contains SUBSTR (both modes).

Success: one "ok" line per kernel (8 without --only), and compute-sanitizer's "RACECHECK SUMMARY:
0 hazards displayed (0 errors, 0 warnings)" (synccheck / memcheck: "ERROR SUMMARY: 0 errors"). Session 16's racecheck of
the dq_writer kernel before the fix (consumers' q_empty arrivals) reported 20482 WAR hazards on the
LSE row of a ring slot (producer cp.async vs the consumers' LSE read).
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # cuflash from the checkout

from cuflash.families.sm90_bwd import Sm90BwdConfig  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

# (causal, seqlen_q, seqlen_k, flags): 5 / 4 Q blocks, ragged; the cluster with an odd K/V-block
# count (a CTA past seqlen_k) too
CASES = [(False, 300, 300, {}), (True, 200, 260, {}),
         (False, 300, 200, dict(cluster=True)), (True, 260, 130, dict(cluster=True)),
         (False, 300, 300, dict(roles=True)), (True, 200, 260, dict(roles=True)),
         # roles on the dynamic scheduler (session 20): more tiles than SMs (160 / 144 of 132), so that CTAs
         # take several (the ring position, the writer's parity and kv_empty across tiles)
         (False, 600, 600, dict(roles=True, dynamic=True)), (True, 1100, 1100, dict(roles=True, dynamic=True))]
# (batch, heads) of a case: 1 x 2, or more where the dynamic scheduler needs more tiles than SMs
SHAPES = {(False, 600, 600): (4, 4), (True, 1100, 1100): (4, 2)}


def selected():
    """The cases whose config name contains --only's argument (all without it)."""
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    out = [(case, Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", case[0], dq_writer=True, **case[3])) for case in CASES]
    return [(case, cfg) for case, cfg in out if only in cfg.name]


def configs():
    return [cfg for _, cfg in selected()]


def main():
    if "--precompile" in sys.argv:
        from cuflash import _gpu, select
        from cuflash.compile import precompile

        todo = configs()
        for (causal, sq, sk, _), _ in selected():
            b, h = SHAPES.get((causal, sq, sk), (1, 2))
            fp = Problem("fwd", "bf16", b, sq, sk, h, h, 256, causal)
            todo.append(select.choose(fp, _gpu.arch(), _gpu.name(), _gpu.max_smem())[1])
        res = precompile(list(dict.fromkeys(todo)))
        for c, secs, err in res:
            print(f"{c.name:<60} {secs:6.1f} s {err[:300] if err else 'ok'}", flush=True)
        return 1 if any(e for _, _, e in res) else 0
    import torch

    import cuflash

    torch.manual_seed(0)
    for (causal, sq, sk, _), cfg in selected():
        b, h = SHAPES.get((causal, sq, sk), (1, 2))
        q, k, v = (torch.randn(b, s, h, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for s in (sq, sk, sk))
        o = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg)
        o.float().square().sum().backward()
        torch.cuda.synchronize()
        assert all(t.grad.isfinite().all() for t in (q, k, v)), cfg.name
        print("ok", cfg.name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
