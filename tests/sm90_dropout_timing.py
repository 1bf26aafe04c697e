"""Timing of dropout on an H100 (issue 12: each feature's overhead <= 10%): dropout_p = 0.1
against the same call without, forward and forward + backward, next to SDPA cuDNN's dropout,
at the FlashAttention benchmark's shape (batch x seqlen = 16k, 2048 / head_dim heads, bf16):

    timeout 300 python tests/sm90_dropout_timing.py --out /tmp/drop2_timing.json
    python tests/sm90_dropout_timing.py --hdims 128 --causal yes --seqlen 8192
    timeout 120 python tests/sm90_dropout_timing.py --hdims 128 --reps 8 --out /tmp/drop4.json  # ~60 s

Rows per case (head dim, mask): plain (what selection runs without dropout), dropout (what
selection runs with it: sm90_fwd at DROPOUT_BN, the backward's dQ path of for_problem), the
dropout forward on the persistent grid with the dynamic scheduler (as plain calls run), with
--variants the dropout forward at the other BNs that compile without spills (multiples of 32,
philox.cuh's 32-key layout) and fa2_fwd's dropout forward, and SDPA cuDNN with and without
dropout, forward, backward alone (torch.autograd.grad of one retained forward) and forward +
backward. The dropout forward's other form of the keep mask (drop_early, sm90_fwd DROPOUT_EARLY:
the Philox rounds in the wait for S_j) is timed next to the heuristic's wherever it applies
(drop_packed head dims), its forms (1: byte signs, 2: fragment masks; non-causal: 4, drawn by the
producer warpgroup, on the static grid, next to form 1 on that grid). "x plain" is ms / the plain cuflash call's ms of the same op. Every kernel is compiled first, in
parallel; samples are CUDA events, interleaved (cuflash.timing.time_interleaved), median.
Not a test.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, registry  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.families import sm90_fwd  # noqa: E402
from cuflash.problem import Problem  # noqa: E402
from cuflash.registry import op_flops  # noqa: E402
from cuflash.select import choose_on_device  # noqa: E402
from cuflash.timing import time_interleaved  # noqa: E402

P = 0.1


def sdpa(q, k, v, causal, p, backend="cudnn"):
    """SDPA's cuDNN (or flash) backend on (b, s, h, d) inputs (its causal is top-left: s_q = s_k here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p,
            is_causal=causal).transpose(1, 2)


def cases(args):
    causals = {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]
    for d in args.hdims:
        for causal in causals:
            s, h = args.seqlen, 2048 // d
            yield d, causal, max(1, 16384 // s), s, h


def fwd_configs(d, causal, b, s, h, variants=False, quick=False, rounds_cost=False, forms=None):
    """The dropout forwards to time: sm90_fwd's heuristic (DROPOUT_BN), the same with the other
    schedule (a CTA per tile, or the persistent grid with the dynamic scheduler, which plain
    calls run); with ``variants`` also its other BNs that pass problems() (no spills, multiples
    of 32) and fa2_fwd's heuristic; with ``forms`` only the heuristic with those drop_early forms."""
    sm90, fa2 = registry.get("sm90_fwd"), registry.get("fa2_fwd")
    drop = Problem("fwd", "bf16", b, s, s, h, h, d, causal, features=("dropout",), dropout_p=P)
    heur = sm90.for_problem(sm90.heuristic(drop), drop)
    out = [heur]
    if forms is not None:
        return out + [c for c in (heur.replace(drop_early=f) for f in forms if heur.drop_packed)
                      if c != heur and not c.problems(227 * 1024)]
    if heur.drop_packed:   # the other forms of the keep mask (drop_early 0, 1, 2)
        for form in (0, 1, 2):
            other = heur.replace(drop_early=form)
            if form == 2 and other.problems(227 * 1024):   # the fragment masks' BN
                other = other.replace(BN=sm90_fwd.DROP_EARLY_MASKS_BN)
            if form != heur.drop_early and not other.problems(227 * 1024):
                out.append(other)
    if heur.drop_packed and not causal:   # drop_early 4 (the producer warpgroup draws), static grid
        four = heur.replace(drop_early=4, dynamic=False)
        if not four.problems(227 * 1024):
            out += [four, heur.replace(dynamic=False)]   # (and its form 1 twin on the same grid)
    if rounds_cost and heur.drop_packed:   # drop_early 3: form 1 without the Philox rounds (NOT the mask)
        sm90_fwd.DROP_EARLY_TIMING = True
        out.append(heur.replace(drop_early=3))
    if quick:   # the heuristic and its other mask forms only
        return out
    for sched in (dict(persistent=False, dynamic=False), dict(persistent=True, dynamic=True)):
        other = heur.replace(tma_store=False, **sched)
        if other not in out and not other.problems(227 * 1024):
            out.append(other)
    if not variants:
        return out
    out += [heur.replace(BN=bn) for bn in (96, 128, 160, 192)
            if bn != heur.BN and not heur.replace(BN=bn).problems(227 * 1024)]
    return out + [fa2.for_problem(fa2.heuristic(drop), drop)]


def timed_rows(rows, case, op, fns, op_names, plain, args, d, causal, b, s, h):
    """Time fns (interleaved, shuffled rounds), print and append one row each."""
    for key, fn in list(fns.items()):   # fail loudly here, outside the timing
        try:
            out = fn()
            assert not out.isnan().any(), f"{op_names[key][1]}: NaN in the output"
        except Exception as e:  # noqa: BLE001 (SDPA cuDNN may refuse a case)
            print(f"{case:<26} {op:<7} {op_names[key][0]:<12} {op_names[key][1]:<64} skipped: "
                  f"{type(e).__name__}: {str(e)[:80]}")
            del fns[key]
    torch.cuda.synchronize()
    times = time_interleaved(fns, reps=args.reps, back_to_back=3, order="shuffle")
    base = times["plain"].median_ms
    flops = op_flops(plain) * {"fwd": 1, "bwd": 2.5, "fwdbwd": 3.5}[op]
    for key, t in times.items():
        impl, cfg = op_names[key]
        row = dict(case=case, op=op, impl=impl, config=cfg, ms=t.median_ms,
                   tflops=flops / t.median_ms / 1e9, x_plain=t.median_ms / base,
                   head_dim=d, causal=causal, batch=b, seqlen=s, nheads=h,
                   dropout_p=0.0 if key in ("plain", "cudnn", "flash") else P)
        rows.append(row)
        print(f"{case:<26} {op:<7} {impl:<12} {cfg[:64]:<64} {t.median_ms:8.3f} "
              f"{row['tflops']:7.1f} {row['x_plain']:8.3f}")


def bwd_variants(d, causal, b, s, h):
    """The dropout backwards to time next to selection's: sm90_bwd with the plain heuristic's speed
    flags (DROPOUT_PLAIN_FLAGS) where they build (d128 non-causal), if selection does not run it,
    and selection's with the other drop_packed forms."""
    from cuflash.families import sm90_bwd

    drop = Problem("bwd", "bf16", b, s, s, h, h, d, causal, features=("dropout",), dropout_p=P)
    sel = choose_on_device(drop, 0)[1]
    if sel.family != "sm90_bwd":
        return []
    out = []
    cfg = sel.replace(**sm90_bwd.DROPOUT_PLAIN_FLAGS)
    if cfg != sel and cfg.dropout_plain() and not cfg.problems(227 * 1024):
        out.append(cfg)
    # drop_packed's forms (kDropPacked: the keep mask on Pᵀ's packed words) other than selection's
    for form in (0, 1, 2):
        other = sel.replace(drop_packed=form)
        if form != sel.drop_packed and not other.problems(227 * 1024):
            out.append(other)
    return out


def case_configs(d, causal, b, s, h, **fwd_kw):
    """Every kernel a case times: selection's plain and dropout forward and backward, fwd_configs(**fwd_kw)
    and bwd_variants (for the precompile scripts too)."""
    todo = []
    for op in ("fwd", "bwd"):
        plain = Problem(op, "bf16", b, s, s, h, h, d, causal)
        for p in (plain, plain.replace(features=("dropout",), dropout_p=P)):
            todo.append(choose_on_device(p, 0)[1])
    return todo + fwd_configs(d, causal, b, s, h, **fwd_kw) + bwd_variants(d, causal, b, s, h)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds-cost", action="store_true",
                    help="also the drop_early 3 timing form (form 1 without the Philox rounds: not the "
                         "dropout mask), which measures what the rounds cost")
    ap.add_argument("--quick", action="store_true",
                    help="the dropout forward's heuristic and its other mask form only (no other schedules)")
    ap.add_argument("--variants", action="store_true",
                    help="also time the dropout forward at its other BNs and fa2_fwd's")
    ap.add_argument("--forms", type=int, nargs="*", default=None,
                    help="time the dropout forward's heuristic with these drop_early forms only (no other "
                         "schedules or mask forms)")
    ap.add_argument("--sdpa-flash", action="store_true", help="also SDPA's flash backend, with and without dropout")
    ap.add_argument("--ops", nargs="+", default=["fwd", "bwd", "fwdbwd"], choices=("fwd", "bwd", "fwdbwd"),
                    help="the ops to time (all three unless given)")
    args = ap.parse_args()
    # selection's dropout backward without drop_packed (the kernel before it), its forms as variants:
    # for_problem keeps a config's own form but turns a 0 into the module's default
    from cuflash.families import sm90_bwd

    sm90_bwd.DROPOUT_PACKED = {}

    # compile everything first, in parallel (selection's plain and dropout kernels, the variants)
    todo = [c for d, causal, b, s, h in cases(args)
            for c in case_configs(d, causal, b, s, h, variants=args.variants, quick=args.quick,
                                  rounds_cost=args.rounds_cost, forms=args.forms)]
    precompile(list(dict.fromkeys(todo)), 0, processes=min(16, os.cpu_count() or 1))

    rows = []
    print(f"{'case':<26} {'op':<7} {'impl':<12} {'config':<64} {'ms':>8} {'TFLOPs':>7} {'x plain':>8}")
    for d, causal, b, s, h in cases(args):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        case = f"d{d} {'causal' if causal else 'full'} b{b} s{s} h{h}"
        plain = Problem("fwd", "bf16", b, s, s, h, h, d, causal)
        drop = plain.replace(features=("dropout",), dropout_p=P)
        names = {
            "plain": ("cuflash", choose_on_device(plain, 0)[1].name),
            "dropout": ("cuflash", choose_on_device(drop, 0)[1].name),
            "cudnn": ("sdpa_cudnn", "no dropout"),
            "cudnn_drop": ("sdpa_cudnn", f"dropout {P}"),
        }
        if args.sdpa_flash:
            names.update(flash=("sdpa_flash", "no dropout"), flash_drop=("sdpa_flash", f"dropout {P}"))
        for op in args.ops:
            def run(fn):
                if op == "fwd":
                    with torch.no_grad():
                        return fn()
                out = fn()
                torch.autograd.grad(out, (q, k, v), dout)
                return out

            if op == "bwd":
                # the backward alone: one forward each (its graph retained), then only the grads
                outs = {"plain": cuflash.flash_attn_func(q, k, v, causal=causal),
                        "dropout": cuflash.flash_attn_func(q, k, v, P, causal=causal),
                        "cudnn": sdpa(q, k, v, causal, 0.0), "cudnn_drop": sdpa(q, k, v, causal, P)}
                if args.sdpa_flash:
                    outs.update(flash=sdpa(q, k, v, causal, 0.0, "flash"), flash_drop=sdpa(q, k, v, causal, P, "flash"))
                op_names = {key: (names[key][0], names[key][1] if key.startswith(("cudnn", "flash")) else choose_on_device(
                    (plain if key == "plain" else drop).replace(op="bwd"), 0)[1].name) for key in outs}
                for i, bcfg in enumerate(bwd_variants(d, causal, b, s, h)):
                    outs[f"b{i}"] = cuflash.flash_attn_func(q, k, v, P, causal=causal, bwd_config=bcfg)
                    op_names[f"b{i}"] = ("cuflash", bcfg.name)
                fns = {key: (lambda o=o: (torch.autograd.grad(o, (q, k, v), dout, retain_graph=True), o)[1])
                       for key, o in outs.items()}
                timed_rows(rows, case, op, fns, op_names, plain, args, d, causal, b, s, h)
                continue

            fns = {"plain": lambda: run(lambda: cuflash.flash_attn_func(q, k, v, causal=causal)),
                   "dropout": lambda: run(lambda: cuflash.flash_attn_func(q, k, v, P, causal=causal)),
                   "cudnn": lambda: run(lambda: sdpa(q, k, v, causal, 0.0)),
                   "cudnn_drop": lambda: run(lambda: sdpa(q, k, v, causal, P))}
            if args.sdpa_flash:
                fns.update(flash=lambda: run(lambda: sdpa(q, k, v, causal, 0.0, "flash")),
                           flash_drop=lambda: run(lambda: sdpa(q, k, v, causal, P, "flash")))
            op_names = dict(names)
            for i, cfg in enumerate(fwd_configs(d, causal, b, s, h, args.variants, args.quick, args.rounds_cost,
                                                args.forms)[1:]):
                fns[f"v{i}"] = (lambda cfg=cfg: run(lambda: cuflash.flash_attn_func(
                    q, k, v, P, causal=causal, config=cfg)))
                op_names[f"v{i}"] = ("cuflash", cfg.name)
                if op == "fwdbwd":
                    op_names[f"v{i}"] = ("cuflash", cfg.name + " + " + choose_on_device(
                        drop.replace(op="bwd"), 0)[1].name)
            if op == "fwdbwd":
                for i, bcfg in enumerate(bwd_variants(d, causal, b, s, h)):
                    fns[f"b{i}"] = (lambda bcfg=bcfg: run(lambda: cuflash.flash_attn_func(
                        q, k, v, P, causal=causal, bwd_config=bcfg)))
                    op_names[f"b{i}"] = ("cuflash", names["dropout"][1] + " + " + bcfg.name)
                bname = choose_on_device(drop.replace(op="bwd"), 0)[1].name
                op_names["dropout"] = ("cuflash", op_names["dropout"][1] + " + " + bname)
                op_names["plain"] = ("cuflash", op_names["plain"][1] + " + "
                                     + choose_on_device(plain.replace(op="bwd"), 0)[1].name)
            timed_rows(rows, case, op, fns, op_names, plain, args, d, causal, b, s, h)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": _gpu.name(0) if hasattr(_gpu, "name") else torch.cuda.get_device_name(0),
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
