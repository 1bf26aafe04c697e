"""Timing of variable-length batches on the H100: the varlen forward on fa2_fwd (what ran before)
against sm90_fwd (a CTA per tile, and persistent) and against the padded dense sm90_fwd call.
Not a test; < 3 min:

    timeout 300 python tests/sm90_varlen_timing.py --out /tmp/sm90_varlen_timing.json
    timeout 120 python tests/sm90_varlen_timing.py --hdims 64 96 --bwd-only --reps 8   # sm90_bwd VARLEN_SMALL_D

Cases, bf16, heads = 2048 / d (16 at d128, 32 at d64), 16k tokens in all: "mixed", sequences
of 512..8k tokens, and "short", sequences of 64..1k (random lengths, fixed seed), causal and
not, d64 and d128. Rows (forward):
  fa2_fwd varlen      varlen_torch.forward with fa2_fwd's varlen heuristic forced (config=)
  sm90 varlen         sm90_fwd's varlen heuristic, a CTA per tile (persistent=False)
  sm90 varlen persist the same tile, persistent schedule
  selection           flash_attn_varlen_func as a user calls it (sm90_fwd's heuristic on the H100)
  dense padded        flash_attn_func on the batch padded to its longest sequence (sm90_fwd)
and forward + backward (the varlen backward is fa2_bwd's; the dense one sm90_bwd's):
  fwdbwd selection    flash_attn_varlen_func + autograd
  fwdbwd dense padded flash_attn_func + autograd on the padded batch
and the varlen backward alone (varlen_torch.backward on the forward's out and LSE):
  bwd fa2_bwd varlen  fa2_bwd's varlen heuristic forced
  bwd sm90_bwd varlen sm90_bwd's varlen heuristic forced (sm90_bwd.VARLEN_BWD switched on for it)
TFLOPs count only the real sequences' attention (FA convention, causal halved; backward 2.5x,
fwd+bwd 3.5x), for every row, the padded one included; "x fa2" is ms / fa2_fwd varlen's ms (fwd
rows), / fwdbwd selection's, or / bwd fa2_bwd varlen's.
Samples interleaved per case (cuflash.timing.time_interleaved). The JSON's "choice" says which
sm90 schedule was faster in how many cases (VARLEN_PERSISTENT, the heuristic's default).
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
# the API's cu_seqlens check reads them back (a host sync per call): off, as the forced rows have none
os.environ.setdefault("CUFLASH_VARLEN_CHECK", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import registry, varlen_torch  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

TOTAL = 16384


def lengths(kind: str, seed: int = 0) -> list:
    """Random sequence lengths summing to TOTAL: 'mixed' 512..8192, 'short' 64..1024."""
    lo, hi = {"mixed": (512, 8192), "short": (64, 1024)}[kind]
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < TOTAL:
        out.append(int(rng.integers(lo, hi + 1)))
    out[-1] -= sum(out) - TOTAL
    if out[-1] < 1:
        out.pop()
        out[-1] += TOTAL - sum(out)
    return out


def flops(lens, h, d, causal) -> float:
    return sum(4.0 * h * n * n * d / (2 if causal else 1) for n in lens)


def case_rows(kind, d, causal):
    h = 2048 // d
    lens = lengths(kind)
    nseq, mx = len(lens), max(lens)
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(TOTAL, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(d)
    p = Problem("fwd", "bf16", nseq, mx, mx, h, h, d, causal, False, ("varlen",))
    fa2, sm90 = registry.get("fa2_fwd"), registry.get("sm90_fwd")
    c_fa2 = fa2.for_problem(fa2.heuristic(p), p)
    c_sm90 = sm90.for_problem(sm90.heuristic(p), p).replace(persistent=False)
    c_pers = c_sm90.replace(persistent=True)
    # the padded dense batch (nseq, max, h, d)
    pad = torch.zeros(3, nseq, mx, h, d, device="cuda", dtype=torch.bfloat16)
    for b, (s0, n) in enumerate(zip(np.cumsum([0] + lens[:-1]), lens)):
        for i, x in enumerate((q, k, v)):
            pad[i, b, :n] = x[s0:s0 + n]
    qp, kp, vp = pad[0], pad[1], pad[2]
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qpg, kpg, vpg = (x.clone().requires_grad_() for x in (qp, kp, vp))
    dout, doutp = torch.randn_like(q), torch.randn_like(qp)

    def fwd(cfg):
        return lambda: varlen_torch.forward(q, k, v, cu, cu, mx, mx, scale, causal, cfg)[0]

    def fwdbwd_varlen():
        out = cuflash.flash_attn_varlen_func(qg, kg, vg, cu, cu, mx, mx, causal=causal)
        torch.autograd.grad(out, (qg, kg, vg), dout)
        return out

    def fwdbwd_dense():
        out = cuflash.flash_attn_func(qpg, kpg, vpg, causal=causal)
        torch.autograd.grad(out, (qpg, kpg, vpg), doutp)
        return out

    fwd_rows = {"fa2_varlen": ("fa2_fwd varlen", c_fa2, fwd(c_fa2)),
                "sm90_varlen": ("sm90 varlen", c_sm90, fwd(c_sm90)),
                "sm90_varlen_persist": ("sm90 varlen persist", c_pers, fwd(c_pers)),
                "selection": ("selection", None,
                              lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)),
                "dense_padded": ("dense padded", None, lambda: cuflash.flash_attn_func(qp, kp, vp, causal=causal))}
    fb_rows = {"fwdbwd_selection": ("fwdbwd selection", None, fwdbwd_varlen),
               "fwdbwd_dense_padded": ("fwdbwd dense padded", None, fwdbwd_dense)}
    pb = p.replace(op="bwd")
    fa2b, sm90b = registry.get("fa2_bwd"), registry.get("sm90_bwd")
    c_fa2b = fa2b.for_problem(fa2b.heuristic(pb), pb)
    c_sm90b = sm90b.for_problem(sm90b.heuristic(pb), pb)
    out, lse = varlen_torch.forward(q, k, v, cu, cu, mx, mx, scale, causal, c_fa2)

    def bwd(cfg):
        def run():
            # sm90_bwd's varlen kernel is off by default (VARLEN_BWD): on for this call only, so
            # the selection rows keep what a user gets
            old, sm90_bwd.VARLEN_BWD = sm90_bwd.VARLEN_BWD, True
            try:
                return varlen_torch.backward(dout, q, k, v, out, lse, cu, cu, mx, mx, scale, causal,
                                             False, cfg)[0]
            finally:
                sm90_bwd.VARLEN_BWD = old
        return run

    b_rows = {"bwd_fa2_varlen": ("bwd fa2_bwd varlen", c_fa2b, bwd(c_fa2b)),
              "bwd_sm90_varlen": ("bwd sm90_bwd varlen", c_sm90b, bwd(c_sm90b))}
    return dict(lens=lens, h=h, flops=flops(lens, h, d, causal)), fwd_rows, fb_rows, b_rows


def case_configs(cases, bwd_only=False) -> list:
    """The kernels of case_rows' forced rows (without tensors): fa2_fwd's varlen forward (the backward
    rows' out and LSE), sm90_fwd's two schedules, fa2_bwd's and sm90_bwd's varlen backwards."""
    out = {}
    for kind, d, causal in cases:
        lens = lengths(kind)
        p = Problem("fwd", "bf16", len(lens), max(lens), max(lens), 2048 // d, 2048 // d, d, causal, False,
                    ("varlen",))
        fa2, sm90 = registry.get("fa2_fwd"), registry.get("sm90_fwd")
        cfgs = [fa2.for_problem(fa2.heuristic(p), p)]
        if not bwd_only:
            c = sm90.for_problem(sm90.heuristic(p), p)
            cfgs += [c.replace(persistent=False), c.replace(persistent=True)]
        pb = p.replace(op="bwd")
        for name in ("fa2_bwd", "sm90_bwd"):
            fam = registry.get(name)
            cfgs.append(fam.for_problem(fam.heuristic(pb), pb))
        out.update({c.name: c for c in cfgs})
    return list(out.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--no-bwd", action="store_true", help="forward rows only")
    ap.add_argument("--bwd-only", action="store_true", help="the backward rows only")
    ap.add_argument("--hdims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--precompile-only", action="store_true",
                    help="compile the cases' kernels (the forward fa2_fwd varlen rows use, the backwards) and stop")
    args = ap.parse_args()
    cases = [(kind, d, causal) for kind in ("mixed", "short") for d in args.hdims for causal in (False, True)]
    if args.precompile_only:
        from cuflash.compile import precompile

        print(f"compiled {len(precompile(case_configs(cases, args.bwd_only)))} kernels")
        return
    built = [case_rows(*c) for c in cases]
    from cuflash.compile import precompile

    cfgs = sorted({cfg for _, rows, _, brows in built
                   for _, cfg, _ in ((*brows.values(),) if args.bwd_only else (*rows.values(), *brows.values()))
                   if cfg is not None}, key=lambda c: c.name)
    failed = [(c.name, e) for c, _, e in precompile(cfgs) if e]
    assert not failed, failed
    results, wins = [], {"per_tile": 0, "persistent": 0}
    print(f"{'case':<22} {'row':<22} {'config':<56} {'ms':>8} {'TFLOPs':>7} {'x fa2':>7}")
    for (kind, d, causal), (info, fwd_rows, fb_rows, b_rows) in zip(cases, built):
        case = f"{kind} d{d} {'causal' if causal else 'full'}"
        outs = {} if args.bwd_only else {key: fn() for key, (_, _, fn) in fwd_rows.items()}   # compile, check
        for key in outs.keys() & {"sm90_varlen", "sm90_varlen_persist", "selection"}:
            assert not outs[key].isnan().any(), f"{case} {key}: NaN"
            diff = (outs[key].float() - outs["fa2_varlen"].float()).abs().max().item()
            assert diff < 0.05, f"{case} {key}: differs from fa2_fwd by {diff}"
        if not args.no_bwd:
            ga, gb = b_rows["bwd_fa2_varlen"][2](), b_rows["bwd_sm90_varlen"][2]()
            assert not gb.isnan().any(), f"{case}: NaN in sm90_bwd's dq"
            diff = (ga.float() - gb.float()).abs().max().item() / max(ga.float().abs().max().item(), 1e-6)
            print(f"{case:<22} dq sm90_bwd vs fa2_bwd: max rel diff {diff:.2e}")
        groups = [fwd_rows] if args.no_bwd else [b_rows] if args.bwd_only else [fwd_rows, fb_rows, b_rows]
        for rows in groups:
            for _, _, fn in rows.values():
                fn()
            torch.cuda.synchronize()
            times = time_interleaved({k: fn for k, (_, _, fn) in rows.items()}, reps=args.reps, back_to_back=3)
            base_key = ("fa2_varlen" if rows is fwd_rows else "fwdbwd_selection" if rows is fb_rows
                        else "bwd_fa2_varlen")
            base = times[base_key].median_ms
            for key, t in times.items():
                label, cfg, _ = rows[key]
                fl = info["flops"] * (1 if rows is fwd_rows else 3.5 if rows is fb_rows else 2.5)
                tflops = fl / t.median_ms / 1e9
                print(f"{case:<22} {label:<22} {cfg.name if cfg else '':<56} {t.median_ms:8.3f} "
                      f"{tflops:7.1f} {t.median_ms / base:7.3f}")
                results.append(dict(case=case, kind=kind, head_dim=d, causal=causal, heads=info["h"],
                                    nseq=len(info["lens"]), lens=info["lens"], row=key, label=label,
                                    config=cfg.name if cfg else "", median_ms=t.median_ms, tflops=tflops,
                                    x_base=t.median_ms / base, spread=t.spread))
            if rows is fwd_rows:
                per, pers = times["sm90_varlen"].median_ms, times["sm90_varlen_persist"].median_ms
                wins["per_tile" if per <= pers else "persistent"] += 1
    print(f"sm90 varlen schedule, faster in: {wins}")
    if args.out:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   cuflash=cuflash.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, total_tokens=TOTAL, choice=wins, rows=results), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
