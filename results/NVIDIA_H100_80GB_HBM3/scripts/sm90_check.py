"""sm90_fwd on the GPU: correctness against the float64 reference, then speed, one child
process per (dtype, head dim, causal) so that a hang (an mbarrier waiting forever) costs one
case its timeout and not the run.

    python results/NVIDIA_H100_80GB_HBM3/scripts/sm90_check.py [--time] [--configs all|heuristic]
        [--hdims 64 128 256] [--dtypes bf16 fp16] [--timeout 90]

Correctness: the FlashAttention rule, |cuflash - ref| <= 2 x |SDPA math in the same precision
- ref| (+ a floor), outputs poisoned with NaN before each launch; LSE against the reference's.
Speed (--time): FA convention (dim 2048, heads 2048/d, batch·seqlen 16k) at seqlen 8k and 16k:
sm90_fwd, fa2_fwd, SDPA flash and cuDNN interleaved in one process (cuflash.bench.common).
Prints one JSON line per result (prefix RESULT).
"""
import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
    (2, 128, 128, 4, 4), (1, 113, 203, 4, 2), (1, 1, 300, 2, 1), (1, 300, 17, 2, 2),
    (1, 1023, 1023, 2, 2), (2, 2049, 2049, 2, 1), (1, 17, 2049, 3, 1),
]


def child(dtype: str, hdim: int, causal: bool, do_time: bool, configs: str, variants: bool) -> None:
    import numpy as np
    import torch

    import cuflash
    from cuflash import api, reference
    from cuflash.bench import common
    from cuflash.problem import Problem
    from cuflash.registry import get

    api.POISON_OUTPUTS = True
    fam = get("sm90_fwd")
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    torch.manual_seed(hdim + causal)

    def cfgs(problem):
        h = fam.for_problem(fam.heuristic(problem), problem)
        if configs == "heuristic":
            return [h]
        out = []
        for c in fam.configs(problem) if hasattr(fam, "configs") else [h]:
            if not c.problems(227 * 1024):
                out.append(c)
        return out or [h]

    for b, sq, sk, h, hkv in SHAPES:
        problem = Problem("fwd", dtype, b, sq, sk, h, hkv, hdim, causal)
        q = torch.randn(b, sq, h, hdim, device="cuda", dtype=tdt)
        k = torch.randn(b, sk, hkv, hdim, device="cuda", dtype=tdt)
        v = torch.randn(b, sk, hkv, hdim, device="cuda", dtype=tdt)
        as64 = lambda x: x.double().cpu().numpy()  # noqa: E731
        ref, ref_lse = reference.attention_naive(as64(q), as64(k), as64(v), causal=causal,
                                                 return_lse=True)
        # same-precision plain attention (SDPA math) for the error rule
        rep = h // hkv
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            if causal and sq != sk:  # bottom-right aligned
                i = torch.arange(sq, device="cuda")[:, None]
                j = torch.arange(sk, device="cuda")[None, :]
                mask = j <= i + sk - sq
                low = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
            else:
                low = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        low = low.transpose(1, 2).double().cpu().numpy()
        ok_rows = ~np.isnan(ref)
        base = np.abs(np.nan_to_num(low) - np.nan_to_num(ref)).max()
        for cfg in cfgs(problem):
            rec = dict(dtype=dtype, hdim=hdim, causal=causal, shape=[b, sq, sk, h, hkv], config=cfg.name)
            try:
                t0 = time.perf_counter()
                out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg,
                                                      return_attn_probs=True)
                torch.cuda.synchronize()
                rec["first_call_s"] = round(time.perf_counter() - t0, 2)
                o = out.double().cpu().numpy()
                err = float(np.abs(o - ref)[ok_rows].max()) if ok_rows.any() else 0.0
                lse_ref = np.where(np.isinf(ref_lse), np.inf, ref_lse)
                l = lse.double().cpu().numpy()
                lse_err = float(np.nanmax(np.abs(np.where(np.isinf(lse_ref) & np.isinf(l), 0, l - lse_ref))))
                rec.update(err=err, sdpa_math_err=float(base), lse_err=lse_err,
                           nan_out=int(np.isnan(o).sum()),
                           ok=bool(err <= 2 * base + 1e-3 and lse_err < 1e-2 and not np.isnan(o).any()))
            except Exception as exc:  # noqa: BLE001
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print("RESULT " + json.dumps(rec), flush=True)
    if do_time:
        for seqlen in (8192, 16384):
            p = Problem("fwd", dtype, 16384 // seqlen, seqlen, seqlen, 2048 // hdim, 2048 // hdim, hdim, causal)
            tensors = common.inputs(p, 3)
            for r in common.compare_op(p, tensors, reps=20):
                print("RESULT " + json.dumps(dict(timing=True, **{k: v for k, v in r.items()})), flush=True)
            if seqlen == 16384 and variants:
                variant_timings(fam, p, tensors)
            del tensors
            common.release()


VARIANTS = {64: [(128, 2, True), (128, 2, False), (160, 2, True), (192, 2, True), (192, 2, False),
                 (128, 3, True), (96, 3, True)],
            128: [(128, 2, True), (128, 2, False), (112, 2, True), (144, 2, True), (176, 2, True),
                  (176, 2, False), (128, 3, True), (96, 3, True)],
            256: [(80, 2, True), (80, 2, False), (64, 2, True), (64, 2, False)]}


def variant_timings(fam, p, tensors):
    """sm90_fwd configs around the heuristic (BN, stages, pingpong), timed interleaved."""
    from cuflash.api import flash_attn_func
    from cuflash.bench import common

    fns = {}
    for bn, stages, pp in VARIANTS.get(p.head_dim, []):
        cfg = fam.heuristic(p).replace(BN=bn, stages=stages, pingpong=pp, BM=128, consumers=2)
        if cfg.problems(227 * 1024):
            continue
        q, k, v = tensors
        fns[cfg.name] = (lambda c: lambda: flash_attn_func(q, k, v, causal=p.causal, config=c))(cfg)
    for name, t in common.measure(fns, reps=20).items():
        rec = dict(variant=True, config=name, hdim=p.head_dim, causal=p.causal, seqlen=p.seqlen_q)
        if isinstance(t, str):
            rec["error"] = t
        else:
            rec.update(ms=t.median_ms, tflops=common.tflops(p, t.median_ms))
        print("RESULT " + json.dumps(rec), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--variants", action="store_true", help="with --time: sm90 configs around the heuristic at 16k")
    ap.add_argument("--configs", default="heuristic")
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--timeout", type=int, default=90)
    a = ap.parse_args()
    if a.child:
        dtype, hdim, causal = a.child
        child(dtype, int(hdim), causal == "1", a.time, a.configs, a.variants)
        return
    causals = {"both": (0, 1), "yes": (1,), "no": (0,)}[a.causal]
    for dtype in a.dtypes:
        for hdim in a.hdims:
            for causal in causals:
                cmd = [sys.executable, __file__, "--child", dtype, str(hdim), str(causal),
                       "--configs", a.configs] + (["--time"] if a.time else []) \
                    + (["--variants"] if a.variants else [])
                t0 = time.time()
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                    sys.stdout.write(r.stdout)
                    if r.returncode:
                        print(f"CHILD {dtype} d{hdim} causal={causal} rc={r.returncode}\n{r.stderr[-3000:]}")
                except subprocess.TimeoutExpired as e:
                    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                    sys.stdout.write(out)
                    print(f"CHILD {dtype} d{hdim} causal={causal} TIMEOUT after {a.timeout}s (hang?)")
                print(f"CHILD {dtype} d{hdim} causal={causal} done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
