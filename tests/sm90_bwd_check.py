"""Quick standalone check of the sm90_bwd family on an H100: one line per case with the
error of dQ, dK, dV against a float64 torch reference, as a multiple of plain low-precision
attention's error (the GPU tests' rule: <= 3, plus one ulp of the largest gradient), so a
failure can be localised to a shape, a mask, a head dim or a config before pytest runs.

    CUDA_LAUNCH_BLOCKING=1 timeout 300 python tests/sm90_bwd_check.py --quick
    python tests/sm90_bwd_check.py            # more shapes, every point of the space
    python tests/sm90_bwd_check.py --det      # also: deterministic mode, bitwise over 5 runs

Exit status 0 when every case passes. Each case runs the forward (the chosen forward family)
and sm90_bwd forced by bwd_config; gradients are NaN-poisoned before the launch.
"""
import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

FAM = registry.get("sm90_bwd")


def attention(q, k, v, causal, scale, dtype):
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)).to(torch.float64 if dtype == torch.float64 else torch.float32) * scale
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0).to(dtype)
    return (p @ v).transpose(1, 2)


def grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def case(dtype, causal, d, sq, sk, h, hkv, batch=2, cfg=None, det=False):
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    p = Problem("bwd", dtype, batch, sq, sk, h, hkv, d, causal, det)
    cc = torch.cuda.get_device_capability()
    why = FAM.supports(cc, p)
    if why:
        return None, f"skip: {why}"
    cfg = cfg or FAM.heuristic(p, cc)
    cfg = FAM.for_problem(cfg, p)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=tdt)
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=tdt)
    v = torch.randn(batch, sk, hkv, d, device="cuda", dtype=tdt)
    dout = torch.randn(batch, sq, h, d, device="cuda", dtype=tdt)
    scale = 1 / math.sqrt(d)
    ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg,
                                                         deterministic=det), q, k, v, dout)
    torch.cuda.synchronize()
    ref = grads(lambda q, k, v: attention(q, k, v, causal, scale, torch.float64), q, k, v, dout.double())
    low = grads(lambda q, k, v: attention(q, k, v, causal, scale, tdt), q, k, v, dout)
    worst, parts = 0.0, []
    for name, a, r, b in zip(("dq", "dk", "dv"), ours, ref, low):
        if a.isnan().any():
            n = int(a.isnan().sum())
            parts.append(f"{name} NaN x{n}")
            worst = math.inf
            continue
        top = r.abs().max().item()
        ulp = torch.finfo(tdt).eps * 2.0 ** math.floor(math.log2(max(top, 2.0 ** -14)))
        floor = max(ulp, 1e-5 * max(1.0, top))
        err = (a.double() - r).abs().max().item()
        base = (b.double() - r).abs().max().item()
        ratio = (err - floor) / base if base > 0 else (0.0 if err <= floor else math.inf)
        worst = max(worst, ratio)
        parts.append(f"{name} {err:.2e} ({ratio:5.2f}x plain {base:.1e})")
    extra = ""
    if det:
        again = [grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg,
                                                               deterministic=True), q, k, v, dout)
                 for _ in range(4)]
        same = all(torch.equal(x, y) for g in again for x, y in zip(ours, g))
        extra = "  bitwise " + ("same" if same else "DIFFERS")
        if not same:
            worst = math.inf
    return worst, f"{cfg.name:<44} {'  '.join(parts)}{extra}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a dozen cases (< 1 minute after compiles)")
    ap.add_argument("--det", action="store_true", help="add deterministic bitwise cases")
    args = ap.parse_args()
    api.POISON_OUTPUTS = True
    cases = []
    for d in (64, 128):
        for causal in (False, True):
            for sq, sk in ((1, 1), (17, 17), (113, 113), (1023, 1023), (113, 301), (301, 113)):
                cases.append(dict(dtype="bf16", causal=causal, d=d, sq=sq, sk=sk, h=4, hkv=4))
        cases.append(dict(dtype="fp16", causal=True, d=d, sq=300, sk=333, h=4, hkv=2))
        cases.append(dict(dtype="bf16", causal=False, d=d, sq=300, sk=333, h=4, hkv=1))
    if args.quick:
        cases = [c for c in cases if (c["sq"], c["sk"]) in ((17, 17), (113, 301), (301, 113), (300, 333), (1023, 1023))]
    else:
        for d in (64, 128):
            for causal in (False, True):
                cases.append(dict(dtype="bf16", causal=causal, d=d, sq=2049, sk=2049, h=4, hkv=4))
                p = Problem("bwd", "bf16", 1, 333, 301, 2, 1, d, causal)
                for cfg in FAM.valid(p, 227 * 1024):
                    cases.append(dict(dtype="bf16", causal=causal, d=d, sq=333, sk=301, h=2, hkv=1,
                                      batch=1, cfg=cfg))
        cases.append(dict(dtype="fp16", causal=False, d=96, sq=200, sk=190, h=4, hkv=2))
    if args.det or not args.quick:
        for d in (64, 128):
            cases.append(dict(dtype="bf16", causal=True, d=d, sq=1023, sk=1100, h=4, hkv=2, det=True))
    print(f"{torch.cuda.get_device_name()}  sm90_bwd, {len(cases)} cases; ratio = (error - 1 ulp) / plain error, pass <= 3")
    failed = 0
    for c in cases:
        label = (f"{c['dtype']} {'causal' if c['causal'] else 'full  '} d{c['d']:<3} "
                 f"{c['sq']:>4}x{c['sk']:<4} h{c['h']}/{c['hkv']}{' det' if c.get('det') else ''}")
        t0 = time.time()
        try:
            worst, line = case(**c)
        except Exception as e:  # noqa: BLE001  (report and go on: localise every failure)
            worst, line = math.inf, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ok = worst is None or worst <= 3
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label:<36} {line}  [{time.time() - t0:.1f}s]", flush=True)
    print(f"{len(cases) - failed}/{len(cases)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
