"""Fill CuPy's kernel cache for what tests/test_distributed_gpu.py (dense cases) and
``bench --mode ring`` compile, in parallel worker processes (not a test; run it first, so
that the one-process-per-GPU runs load every kernel from disk instead of each rank compiling
the same ones).

    python tests/ring_precompile.py [--procs 2 4] [--seqlens 262144 524288 1048576]

The configs are what selection picks (tuned table or heuristic) for every call shape the
ring makes at those P: the rank's own block (2 chunks x 2 chunks, causal or not), the
half-block steps (2 x 1 and 1 x 2 chunks, not causal), the varlen-free contiguous layout's
1 x 1 chunk calls, and the single-GPU flash_attn_func calls next to them (the whole test
sequence, the bench's per-GPU shard), forward and backward (and deterministic for the test's
first case), and the varlen test's calls (one chunk of every sequence against one chunk, and
the whole batch on one GPU). Forward configs also as cuflash.distributed's flags would change
them: on the dynamic scheduler (FWD_DYNAMIC) and, non-causal, on a grid of one CTA per tile
(FWD_GRID_STEPS; --no-grid skips these); backward configs also with dq_first and dq_convert off
(DQ_IN_WORKSPACE's calls), and the calls per group of heads (BWD_HEAD_GROUPS, FWD_HEAD_GROUPS:
the --head-groups counts, default 4).
"""
import argparse
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.dirname(_here)]  # cuflash from the checkout

from cuflash import _gpu, select  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.problem import Problem  # noqa: E402


def _shapes(P: int, chunk: int, layout: str, causal: bool) -> list:
    """(seqlen_q, seqlen_k, causal) of every ring call at P ranks, chunk positions per chunk."""
    if layout == "contiguous":
        return [(chunk, chunk, causal), (chunk, chunk, False), (P * chunk, P * chunk, causal)]
    two, one = 2 * chunk, chunk
    out = [(two, two, causal), (two * P, two * P, causal)]  # own block; one GPU, whole sequence
    out += [(two, one, False), (one, two, False)] if causal else [(two, two, False)]
    return out


def problems(procs, seqlens, head_groups=(4, 8)) -> list:
    from test_distributed_gpu import CASES, FLAG_CASES, VARLEN_CASES

    from cuflash import distributed as cfd
    from cuflash.bench.ring import WARM_LOCAL

    probs = []
    for P in procs:
        start = len(probs)
        for i, (b, n, h, hk, d, causal, layout, dt) in enumerate(CASES + FLAG_CASES):
            for sq, sk, c in _shapes(P, n, layout, causal):
                for op in ("fwd", "bwd"):
                    for det in ((False, True) if op == "bwd" and i == 0 else (False,)):
                        probs.append(Problem(op, dt, b, sq, sk, h, hk, d, c, det))
        for units, h, hk, d, causal, layout, dt in VARLEN_CASES:  # one varlen call per pair
            n = 2 * P if layout == "zigzag" else P
            longest = max(units) * n
            for sq, c in ((longest // n, causal), (longest // n, False), (longest, causal)):
                for op in ("fwd", "bwd"):
                    probs.append(Problem(op, dt, len(units), sq, sq, h, hk, d, c,
                                         features=("varlen",)))
        for s in seqlens:  # bench: batch 1, 8 heads, d128, bf16; the shard is s / P long
            for causal in (True, False):
                shapes = _shapes(P, s // (2 * P), "zigzag", causal)
                shapes.append((s // P, s // P, causal))  # cuflash_shard
                warm = _shapes(P, min(s // P, WARM_LOCAL) // 2, "zigzag", causal)
                shapes += warm[:1] + warm[2:]  # --ring-ab's warm-up ring (not its whole sequence)
                for sq, sk, c in shapes:
                    for op in ("fwd", "bwd"):
                        probs.append(Problem(op, "bf16", 1, sq, sk, 8, 8, 128, c))
        for p in probs[start:]:  # the calls per head group (BWD_HEAD_GROUPS, FWD_HEAD_GROUPS)
            if not p.features:
                for want in head_groups:
                    g = cfd._head_groups(p.nheads_kv, want)
                    if g > 1:
                        probs.append(Problem(p.op, p.dtype, p.batch, p.seqlen_q, p.seqlen_k,
                                             p.nheads // g, p.nheads_kv // g, p.head_dim,
                                             p.causal, p.deterministic))
    return list(dict.fromkeys(probs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, nargs="+", default=[2])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[262144, 524288])
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--head-groups", type=int, nargs="*", default=[4, 8],
                    help="the calls per so many groups of heads too (BWD_HEAD_GROUPS, "
                         "FWD_HEAD_GROUPS; bench --ring-ab bwd_groupsN, fwd_groupsN)")
    ap.add_argument("--no-grid", dest="grid", action="store_false",
                    help="skip the non-persistent forward configs of FWD_GRID_STEPS (bench "
                         "--ring-ab fwd_gridN)")
    a = ap.parse_args(argv)
    arch, smem, name = _gpu.arch(), _gpu.max_smem(), _gpu.name()
    configs = []
    for p in problems(a.procs, a.seqlens, a.head_groups):
        try:
            cfg = select.choose(p, arch, name, smem)[1]
        except ValueError as exc:
            print(f"skip {p}: {exc}", flush=True)
            continue
        configs.append(cfg)
        flags = {f: False for f in ("dq_first", "dq_convert") if getattr(cfg, f, False)}
        if p.op == "bwd" and flags:  # distributed.DQ_IN_WORKSPACE's config (_acc_plan)
            try:
                configs.append(select.choose(p, arch, name, smem, cfg.replace(**flags))[1])
            except ValueError as exc:
                print(f"skip the dQ-in-workspace config of {p}: {exc}", flush=True)
        # (distributed._forward_config: stream_tail goes with the static schedule)
        tail = {"stream_tail": False} if getattr(cfg, "stream_tail", False) else {}
        if p.op == "fwd" and not p.features and getattr(cfg, "persistent", False) \
                and getattr(cfg, "dynamic", None) is False:  # distributed.FWD_DYNAMIC's config
            alt = cfg.replace(dynamic=True, **tail)
            if not alt.problems(smem):
                configs.append(alt)
        if a.grid and p.op == "fwd" and not p.features and not p.causal and p.seqlen_k >= 2048 \
                and getattr(cfg, "persistent", False):  # distributed.FWD_GRID_STEPS' config (the
            # bench's calls and the GPU test's FLAG_CASES: the small cases never run it)
            alt = cfg.replace(persistent=False, dynamic=False, tile_overlap=False, section=0, **tail)
            if not alt.problems(smem):
                configs.append(alt)
    configs = list(dict.fromkeys(configs))
    print(f"ring precompile: {len(configs)} configs", flush=True)
    t0 = time.perf_counter()
    errors = [r for r in precompile(configs, processes=a.processes) if r[2]]
    for cfg, _, err in errors:
        print(f"FAILED {cfg.name}: {err}", flush=True)
    print(f"ring precompile: {time.perf_counter() - t0:.0f} s, {len(errors)} failed", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
