"""Timing of sm90_fwd's non-causal d128 / d256 forward on an H100 (issue 11: the last cells below SDPA
cuDNN: d128 16k, d256 2k-16k). Not a test; < 80 s with its compiles (done first, in parallel):

    timeout 300 python tests/sm90_fwd_nc_timing.py --out /tmp/nc_timing.json

Cases: --dtype (bf16, fp16 or bf16,fp16), head dims --dims (128,256), seqlen --seqlens (2k / 4k / 8k /
16k), non-causal, the benchmark's shape (dim 2048: 2048 / d heads; batch x seqlen = 16k). Each row is
a change to the heuristic's config of the case (rows equal to the heuristic's config or an earlier
row's, or invalid, are left out; --rows for bf16, --fp16-rows for fp16):
  heur          today's heuristic (Sm90Forward.heuristic: 2 consumer warpgroups, persistent; from the
                2048 bucket HEURISTIC_NC: d128 static persistent, pingpong, BN 160 + TMA store below 16k
                keys, BN 176 from 16k; d256 static persistent without pingpong, BN 80)
  dyn           the dynamic scheduler with pingpong (the heuristic before HEURISTIC_NC)
  sec1          dyn with sections of one KV head (``section``: a run-time param, dyn's kernel)
  rf            the heuristic's tile with rescale_first (kRescaleFirst: O *= alpha under the next S
                GEMM, FA3's order above head dim 128)
  nopp / pp     the heuristic's tile without / with pingpong
  static        the heuristic's tile, a CTA per tile (no persistent schedule)
  bn176 / bn160_tmao  d128 at that BN (register epilogue / TMA-store epilogue)
  bn64          d256 at BN 64
  (more in CANDIDATES: bn128_s3, c1_bn96, sec2, sec16, nopp_rf)
  sdpa_cudnn, sdpa_flash  torch SDPA on cuDNN and on its flash backend, same tensors
Two regimes: back to back (the bench's: samples of 5 calls) and, with --flush-reps > 0, single calls
after an L2 flush (the tuner's). In both the rows' samples are interleaved and the row order rotates
by one each sample (under sustained load the H100's clock sinks along a round of rows and recovers
during the slow SDPA flash row: with a fixed order the row after it looked fastest). "x cuDNN" is a
row's TFLOPs over cuDNN's in the same regime. Every row's output is checked against the first row's
(NaN-free, max difference < 2e-2).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

# row -> changes to the heuristic's config of the case (None: the heuristic as it is)
CANDIDATES = {
    "heur": None,
    "dyn": dict(dynamic=True, pingpong=True),
    "sec1": dict(dynamic=True, pingpong=True, section=1),
    "rf": dict(rescale_first=True),
    "nopp": dict(pingpong=False),
    "pp": dict(pingpong=True),
    "static": dict(persistent=False, dynamic=False),
    "bn176": dict(BN=176, tma_store=False),
    "bn160_tmao": dict(BN=160, tma_store=True),
    "bn64": dict(BN=64, tma_store=False),
    "bn128_s3": dict(BN=128, stages=3, tma_store=False),
    "nopp_rf": dict(pingpong=False, rescale_first=True),
    "c1_bn96": dict(BM=64, consumers=1, pingpong=False, BN=96, tma_store=False, dynamic=False),
    "sec2": dict(dynamic=True, pingpong=True, section=2),
    "sec16": dict(dynamic=True, pingpong=True, section=16),
}
# the rows of each head dim (others do not fit or are not meant for it)
ROWS = {128: ("heur", "dyn", "sec1", "rf", "nopp", "bn176", "bn160_tmao", "bn128_s3", "nopp_rf", "sec2", "sec16"),
        256: ("heur", "dyn", "sec1", "rf", "pp", "static", "bn64", "c1_bn96", "sec2", "sec16")}
DEFAULT_ROWS = ("heur", "dyn", "sec1", "rf", "nopp", "pp", "static", "bn176", "bn160_tmao", "bn64")
FP16_ROWS = "heur,dyn"


def case_configs(d, s, dtype, rows_wanted, quiet=False):
    """(problem, {row: config}) of one case; rows whose config is invalid or the heuristic's own
    (but heur) are left out."""
    from cuflash import registry
    from cuflash.problem import Problem

    fam = registry.get("sm90_fwd")
    h, b = 2048 // d, 16384 // s
    problem = Problem("fwd", dtype, b, s, s, h, h, d, False)
    # the heuristic's tile as it was before stream_tail and lazy_rescale (session 17: HEURISTIC_STREAM_TAIL;
    # session 22: HEURISTIC_LAZY; both timed by tests/sm90_fwd_cells_timing.py), so that this study's rows and
    # kernels stay what they were
    heur = fam.heuristic(problem).replace(stream_tail=False, lazy_rescale=False)
    base = heur
    out = {}
    for key in rows_wanted:
        if key not in ROWS[d]:
            continue
        change = CANDIDATES[key]
        cfg = heur if change is None else base.replace(**change)
        if key != "heur" and (cfg == heur or cfg in out.values()):
            continue
        why = cfg.problems(227 * 1024)
        if why:
            if not quiet:
                print(f"  skipped {key} {cfg.name}: {'; '.join(why)}")
            continue
        out[key] = cfg
    return problem, out


def all_configs(dtypes=("bf16", "fp16"), dims=(128, 256), seqlens=(2048, 4096, 8192, 16384),
                rows_wanted=DEFAULT_ROWS):
    """Every kernel the timing compiles, one config per kernel (``section`` is a run-time param:
    configs differing only in it share their compiled kernel, CuPy's disk cache)."""
    by_kernel = {}
    for dtype in dtypes:
        for d in dims:
            for s in seqlens:
                for c in case_configs(d, s, dtype, rows_wanted, True)[1].values():
                    by_kernel.setdefault(c.kernel_name(), c.replace(section=0))
    return list(by_kernel.values())


def test_kernel_configs():
    """The kernels of tests/test_sm90_fwdnc_gpu.py (their tiles do not depend on the test's shapes)."""
    import cuflash
    from cuflash import registry

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_sm90_fwdnc_gpu as t

    fam = registry.get("sm90_fwd")
    out = []
    for dtype, d, causal, change in t.KERNELS:
        p = cuflash.Problem("fwd", dtype, 2, 2049, 2049, 16, 4, d, causal)
        out.append(t.tile_of(fam.for_problem(fam.heuristic(p), p), change))
    return out


def case_rows(d, s, dtype, rows_wanted):
    import torch

    import cuflash

    problem, cfgs = case_configs(d, s, dtype, rows_wanted)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(problem.batch, s, problem.nheads, d, device="cuda", dtype=tdt) for _ in range(3))
    out = {key: (cfg, lambda cfg=cfg: cuflash.flash_attn_func(q, k, v, config=cfg)) for key, cfg in cfgs.items()}
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt)
        return fn

    out["sdpa_cudnn"] = (None, sdpa(SDPBackend.CUDNN_ATTENTION))
    out["sdpa_flash"] = (None, sdpa(SDPBackend.FLASH_ATTENTION))
    return problem, out, (q, k, v)


def time_rotated(fns: dict, reps: int, back_to_back: int, flush_l2: bool = False) -> dict:
    """{row: Timing}: ``reps`` samples per row (``back_to_back`` calls each, or one call after an L2
    flush), the rows interleaved and their order rotated by one every sample (docstring: why)."""
    import statistics

    from cuflash.timing import Timing, _sample, l2_flusher, warm_up

    flush = l2_flusher() if flush_l2 else None
    for fn in fns.values():
        warm_up(fn, 3)
    keys = list(fns)
    samples = {k: [] for k in keys}
    for r in range(reps):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        got = _sample({k: fns[k] for k in order}, 1, 1 if flush_l2 else back_to_back, flush)
        for k in keys:
            samples[k] += got[k].samples
    return {k: Timing(statistics.median(v), tuple(v), 1 if flush_l2 else back_to_back, flush_l2)
            for k, v in samples.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bf16,fp16", help="bf16, fp16 or both: bf16,fp16")
    ap.add_argument("--dims", default="128,256")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="rows of the bf16 cases")
    ap.add_argument("--flush-reps", type=int, default=10, help="single calls after an L2 flush (0: none)")
    ap.add_argument("--fp16-rows", default=FP16_ROWS,
                    help="rows of the fp16 cases")
    ap.add_argument("--precompile-only", action="store_true", help="compile the kernels and stop")
    ap.add_argument("--with-tests", action="store_true",
                    help="also compile tests/test_sm90_fwdnc_gpu.py's kernels (test_kernel_configs)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    dtypes = args.dtype.split(",")
    assert set(dtypes) <= {"bf16", "fp16"}, f"--dtype: bf16 and / or fp16, got {args.dtype}"
    rows_of = {"bf16": tuple(args.rows.split(",")), "fp16": tuple(args.fp16_rows.split(","))}
    for rows in rows_of.values():
        unknown = set(rows) - set(CANDIDATES)
        assert not unknown, f"unknown rows {sorted(unknown)}; known: {', '.join(CANDIDATES)}"
    dims = tuple(map(int, args.dims.split(",")))
    seqlens = tuple(map(int, args.seqlens.split(",")))
    assert set(dims) <= set(ROWS), f"--dims: some of {tuple(ROWS)}"

    import time

    from cuflash.compile import precompile

    t0 = time.time()
    kernels = [c for dt in dtypes for c in all_configs((dt,), dims, seqlens, rows_of[dt])]
    if args.with_tests:
        have = {c.kernel_name() for c in kernels}
        kernels += [c for c in test_kernel_configs() if c.kernel_name() not in have]
    failed = [(c.name, e[-1500:]) for c, _, e in precompile(kernels) if e]
    print(f"compiled {len(kernels)} kernels in {time.time() - t0:.0f} s", flush=True)
    assert not failed, failed
    if args.precompile_only:
        return

    import torch

    import cuflash
    from cuflash.registry import op_flops

    cases = [(dt, d, s) for dt in dtypes for d in dims for s in seqlens]
    results = []
    print(f"{'case':<20} {'mode':<5} {'row':<12} {'config':<66} {'ms':>8} {'TFLOPs':>7} {'x cuDNN':>8}")
    for dtype, d, s in cases:
        problem, rows, tensors = case_rows(d, s, dtype, rows_of[dtype])
        case = f"{dtype} d{d} s{s} full"
        fns = {key: fn for key, (_, fn) in rows.items()}
        ref = None
        for key, fn in fns.items():   # compile / plan outside the timing; outputs agree
            out = fn()
            if key.startswith("sdpa"):
                continue
            assert not out.isnan().any(), f"{case} {key}: NaN in the output"
            if ref is None:
                ref = out
            else:
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 2e-2, f"{case} {key}: differs from the first row by {err:.3g}"
        torch.cuda.synchronize()
        regimes = {"b2b": time_rotated(fns, args.reps, 5)}
        if args.flush_reps > 0:
            regimes["flush"] = time_rotated(fns, args.flush_reps, 1, flush_l2=True)
        for regime, times in regimes.items():
            cudnn = op_flops(problem) / times["sdpa_cudnn"].median_ms / 1e9
            for key, t in times.items():
                cfg, _ = rows[key]
                tflops = op_flops(problem) / t.median_ms / 1e9
                name = cfg.name if cfg is not None else ""
                print(f"{case:<20} {regime:<5} {key:<12} {name:<66} {t.median_ms:8.3f} {tflops:7.1f} "
                      f"{tflops / cudnn:8.3f}", flush=True)
                results.append(dict(case=case, head_dim=d, seqlen=s, causal=False, dtype=dtype, regime=regime,
                                    batch=problem.batch, heads=problem.nheads, row=key, config=name,
                                    median_ms=t.median_ms, tflops=tflops, x_cudnn=tflops / cudnn,
                                    spread=t.spread))
        del tensors, fns, rows
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   cudnn=torch.backends.cudnn.version(), cuflash=cuflash.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=results), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
