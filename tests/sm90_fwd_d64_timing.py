"""Timing of sm90_fwd at head dim 64 on an H100 (issue 11: the forward at >= 1.0x SDPA cuDNN in every
cell >= 2k; d64 is the one left below). Not a test; < 60 s with its compiles:

    timeout 300 python tests/sm90_fwd_d64_timing.py --out /tmp/d64_timing.json

Cases: bf16 (--dtype: bf16, fp16 or bf16,fp16), head dim 64, seqlen 2k / 4k / 8k / 16k, causal and not, the benchmark's shape
(dim 2048: 32 heads; batch x seqlen = 16k). Rows per case, samples interleaved
(cuflash.timing.time_interleaved, CUDA events, warm-up, median of --reps samples of 5 calls):
  heur        today's heuristic (Sm90Forward.heuristic; from the 2048 bucket HEURISTIC_D64's tile:
              BM 192, BN 128, 3 consumer warpgroups, pingpong, dynamic persistent, i.e. c3_bn128)
  c3_bn128    3 consumer warpgroups (BM 192), BN 128, P in registers (FA3's causal d64 tile)
  c3_bn176_ps 3 consumer warpgroups, BN 176, P through shared memory (p_smem)
  c3_bn192_ps 3 consumer warpgroups, BN 192, P through shared memory (FA3's non-causal d64 tile;
              non-causal only: the causal one exceeds the registers, MAX_ACCUM_REGS_PSMEM_MASKED)
  heur_tree   the heuristic's tile with tree_max (softmax_tree.cuh: shorter dependency chains in
              the row max)
  heur_q2     the heuristic's tile with q_double (two Q buffers: the next tile's Q loads early)
  c3_bn176_pstq, c3_bn192_pstq  the p_smem tiles with tree_max and q_double
  (all persistent with the dynamic scheduler, as the heuristic's plain calls)
  sdpa_cudnn, sdpa_flash  torch SDPA on cuDNN and on its flash backend, same tensors
"x cuDNN" is the row's TFLOPs / cuDNN's. Every forced kernel is compiled up front in parallel.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

# row -> changes to the dynamic persistent 2-consumer tile (None: the heuristic as it is)
CANDIDATES = {
    "heur": None,
    "heur_tree": dict(tree_max=True),
    "heur_q2": dict(q_double=True),
    "c3_bn128": dict(BM=192, consumers=3, BN=128),
    "c3_bn176_ps": dict(BM=192, consumers=3, BN=176, p_smem=True),
    "c3_bn192_ps": dict(BM=192, consumers=3, BN=192, p_smem=True),
    "c3_bn176_pstq": dict(BM=192, consumers=3, BN=176, p_smem=True, tree_max=True, q_double=True),
    "c3_bn192_pstq": dict(BM=192, consumers=3, BN=192, p_smem=True, tree_max=True, q_double=True),
}


def case_configs(d, s, causal, dtype, rows_wanted, quiet=False):
    """(problem, {row: config}) of one case; rows whose config is invalid are left out."""
    fam = registry.get("sm90_fwd")
    h, b = 2048 // d, 16384 // s
    problem = Problem("fwd", dtype, b, s, s, h, h, d, causal)
    heur = fam.heuristic(problem)
    out = {}
    for key in rows_wanted:
        change = CANDIDATES[key]
        if change is None:
            cfg = heur
        elif set(change) <= {"tree_max", "q_double"}:
            cfg = heur.replace(**change)
        else:
            cfg = heur.replace(pingpong=True, persistent=True, dynamic=True, tma_store=False, **change)
        why = cfg.problems(227 * 1024)
        if why:
            if not quiet:
                print(f"  skipped {key} {cfg.name}: {'; '.join(why)}")
            continue
        out[key] = cfg
    return problem, out


def all_configs(dtype="bf16", seqlens=(2048, 4096, 8192, 16384), rows_wanted=tuple(CANDIDATES)):
    """Every kernel the timing compiles (tests/sm90_fwd_d64_precompile.py)."""
    return list(dict.fromkeys(c for s in seqlens for causal in (False, True)
                              for c in case_configs(64, s, causal, dtype, rows_wanted, True)[1].values()))



def case_rows(d, s, causal, dtype, rows_wanted):
    problem, cfgs = case_configs(d, s, causal, dtype, rows_wanted)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(problem.batch, s, problem.nheads, d, device="cuda", dtype=tdt) for _ in range(3))
    out = {key: (cfg, lambda cfg=cfg: cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg))
           for key, cfg in cfgs.items()}
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return fn

    out["sdpa_cudnn"] = (None, sdpa(SDPBackend.CUDNN_ATTENTION))
    out["sdpa_flash"] = (None, sdpa(SDPBackend.FLASH_ATTENTION))
    return problem, out, (q, k, v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bf16", help="bf16, fp16 or both: bf16,fp16")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--rows", default=",".join(CANDIDATES))
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    rows_wanted = args.rows.split(",")
    dtypes = args.dtype.split(",")
    assert set(dtypes) <= {"bf16", "fp16"}, f"--dtype: bf16 and / or fp16, got {args.dtype}"
    cases = [(dt, 64, s, c) for dt in dtypes for s in map(int, args.seqlens.split(",")) for c in (False, True)]
    from cuflash.compile import precompile

    built = [case_rows(d, s, c, dt, rows_wanted) for dt, d, s, c in cases]
    cfgs = list(dict.fromkeys(cfg for _, rows, _ in built for cfg, _ in rows.values() if cfg is not None))
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    assert not failed, failed
    results = []
    print(f"{'case':<23} {'row':<14} {'config':<62} {'ms':>8} {'TFLOPs':>7} {'x cuDNN':>8}")
    for (dtype, d, s, causal), (problem, rows, tensors) in zip(cases, built):
        case = f"{dtype} d{d} s{s} {'causal' if causal else 'full'}"
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
        times = time_interleaved(fns, reps=args.reps, back_to_back=5)
        cudnn = op_flops(problem) / times["sdpa_cudnn"].median_ms / 1e9
        for key, t in times.items():
            cfg, _ = rows[key]
            tflops = op_flops(problem) / t.median_ms / 1e9
            name = cfg.name if cfg is not None else ""
            print(f"{case:<23} {key:<14} {name:<62} {t.median_ms:8.3f} {tflops:7.1f} {tflops / cudnn:8.3f}",
                  flush=True)
            results.append(dict(case=case, head_dim=d, seqlen=s, causal=causal, dtype=dtype,
                                batch=problem.batch, heads=problem.nheads, row=key, config=name,
                                median_ms=t.median_ms, tflops=tflops, x_cudnn=tflops / cudnn, spread=t.spread))
        del tensors
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   cudnn=torch.backends.cudnn.version(), cuflash=cuflash.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=results), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
