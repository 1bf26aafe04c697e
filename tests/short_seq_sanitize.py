"""Shapes for compute-sanitizer over issue 12's short-sequence kernels and route: run under it, not under pytest.

    compute-sanitizer --tool memcheck python tests/short_seq_sanitize.py
    compute-sanitizer --tool racecheck python tests/short_seq_sanitize.py --quick
    compute-sanitizer --tool synccheck python tests/short_seq_sanitize.py --quick

* sm90_bwd's head-dim-64 kernel with wide_epi (the heuristic's tile): dk, dv equal bit for bit to the same kernel
  without it, dq within 1e-2 (unordered fp32 additions), no NaN (outputs poisoned);
* sm90_fwd's head-dim-64 tile with the short-key BNs (tests/test_short_seq_gpu.py SHORT_BNS): out equal bit for
  bit across BNs is not expected (another summation order): out within 2e-2 of the default tile's, no NaN;
* flash_attn_qkvpacked_func's packed gradient (dq, dk, dv written into one strided buffer): equal bit for bit to
  the per-slice route's, deterministic.
--quick: one shape per part (racecheck / synccheck are slow); without it also a shape with more K/V tiles than
SMs (the dynamic scheduler's tile claims across tiles). --rest: the default kernels --quick leaves out
(--rest --precompile: compile them first, in parallel processes, and exit). --s31: session 31's short-call
defaults (S31_FWD, S31_BWD; with --quick, fewer; with --fp16, the fp16 ones --quick leaves out; --s31 --precompile
compiles them).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _gpu, api, registry  # noqa: E402
from cuflash.problem import Problem  # noqa: E402

SHORT_BNS = (112, 128, 144, 160, 176)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def bwd_part(cases):
    fam = registry.get("sm90_bwd")
    for dtype, b, sq, sk, h, causal in cases:
        p = Problem("bwd", dtype, b, sq, sk, h, h, 64, causal)
        base = fam.for_problem(fam.heuristic(p, _gpu.arch()), p).replace(wide_epi=False)
        cfg = base.replace(wide_epi=True)
        assert not cfg.problems() and fam.for_problem(cfg, p) == cfg, cfg.name
        q, k, v, dout = (rand(b, s, h, 64, dtype=DTYPES[dtype]) for s in (sq, sk, sk, sq))
        got = {}
        for c in (base, cfg):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o = cuflash.flash_attn_func(*leaves, causal=causal, bwd_config=c)
            g = torch.autograd.grad(o, leaves, dout)
            assert not any(x.isnan().any() for x in g), f"{c.name}: NaN"
            got[c.name] = g
        ref, new = got[base.name], got[cfg.name]
        assert torch.equal(ref[1], new[1]) and torch.equal(ref[2], new[2]), f"{cfg.name}: dk / dv differ"
        err = ((ref[0].float() - new[0].float()).abs().max() / ref[0].float().abs().max()).item()
        assert err < 1e-2, f"{cfg.name}: dq {err}"
        torch.cuda.synchronize()
        print("ok bwd", cfg.name, (b, sq, sk, h), f"dq diff {err:.1e}", flush=True)


def fwd_part(cases, bns):
    fam = registry.get("sm90_fwd")
    for dtype, b, sq, sk, h, causal in cases:
        p = Problem("fwd", dtype, b, sq, sk, h, h, 64, causal)
        base = fam.for_problem(fam.heuristic(p, _gpu.arch()), p)
        q, k, v = (rand(b, s, h, 64, dtype=DTYPES[dtype]) for s in (sq, sk, sk))
        ref = cuflash.flash_attn_func(q, k, v, causal=causal, config=base)
        for bn in bns:
            cfg = base.replace(BN=bn)
            assert not cfg.problems() and fam.for_problem(cfg, p) == cfg, cfg.name
            out = cuflash.flash_attn_func(q, k, v, causal=causal, config=cfg)
            assert not out.isnan().any(), f"{cfg.name}: NaN"
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
            assert err < 2e-2, f"{cfg.name}: out differs from {base.name} by {err}"
            torch.cuda.synchronize()
            print("ok fwd", cfg.name, (b, sq, sk, h), f"diff {err:.1e}", flush=True)


def packed_part(cases):
    for b, s, h, causal in cases:
        qkv = rand(b, s, 3, h, 64)
        dout = rand(b, s, h, 64)
        x = qkv.detach().requires_grad_()
        (g,) = torch.autograd.grad(cuflash.flash_attn_qkvpacked_func(x, causal=causal, deterministic=True), x, dout)
        y = qkv.detach().requires_grad_()
        o = cuflash.flash_attn_func(y[:, :, 0], y[:, :, 1], y[:, :, 2], causal=causal, deterministic=True)
        (g2,) = torch.autograd.grad(o, y, dout)
        assert not g.isnan().any() and torch.equal(g, g2), "packed gradient differs from the per-slice route's"
        torch.cuda.synchronize()
        print("ok packed", (b, s, h, causal), flush=True)


def main_fwd_config(fam, p):
    """main's forward config at session 31's start for p: the heuristic without the short-call fields."""
    from cuflash.families import sm90_fwd

    saved = sm90_fwd.SHORT_KEYS_FIELDS, sm90_fwd.SHORT_CAUSAL_FIELDS
    sm90_fwd.SHORT_KEYS_FIELDS, sm90_fwd.SHORT_CAUSAL_FIELDS = {}, {}
    try:
        return fam.for_problem(fam.heuristic(p, _gpu.arch()), p)
    finally:
        sm90_fwd.SHORT_KEYS_FIELDS, sm90_fwd.SHORT_CAUSAL_FIELDS = saved


def s31_fwd_part(cases):
    """The session-31 short-call forward defaults (static persistent + tma_store; causal BN 128 + q_double +
    tma_store) against main's config: out within 2e-2, no NaN."""
    fam = registry.get("sm90_fwd")
    for dtype, b, sq, sk, h, causal in cases:
        p = Problem("fwd", dtype, b, sq, sk, h, h, 64, causal)
        new, old = fam.for_problem(fam.heuristic(p, _gpu.arch()), p), main_fwd_config(fam, p)
        assert new != old and not new.problems(), (new.name, new.problems())
        q, k, v = (rand(b, s, h, 64, dtype=DTYPES[dtype]) for s in (sq, sk, sk))
        ref = cuflash.flash_attn_func(q, k, v, causal=causal, config=old)
        out = cuflash.flash_attn_func(q, k, v, causal=causal, config=new)
        assert not out.isnan().any(), f"{new.name}: NaN"
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
        assert err < 2e-2, f"{new.name}: out differs from {old.name} by {err}"
        torch.cuda.synchronize()
        print("ok s31 fwd", new.name, (b, sq, sk, h), f"diff {err:.1e}", flush=True)


# the session-31 defaults: non-causal short keys (static + tma_store), causal below the 2048 bucket
# (more tiles than SMs at 40 heads x 8 Q blocks: the persistent CTAs' second Q buffer in use); causal backward with
# wide_epi; every short-key width in both dtypes. --s31 --quick: the first three forward cases (both masks, both
# dtypes) and the first backward case
S31_FWD = [("bf16", 1, 197, 197, 2, False), ("bf16", 1, 1024, 1024, 40, True), ("fp16", 1, 128, 128, 2, False),
           ("fp16", 1, 113, 301, 2, True), ("bf16", 1, 577, 577, 2, False), ("fp16", 1, 301, 113, 20, True),
           ("bf16", 1, 257, 257, 2, False), ("bf16", 1, 700, 700, 2, False), ("bf16", 1, 384, 384, 2, False),
           ("bf16", 1, 128, 128, 2, False), ("fp16", 1, 197, 197, 2, False), ("fp16", 1, 257, 257, 2, False),
           ("fp16", 1, 577, 577, 2, False), ("fp16", 1, 700, 700, 2, False), ("fp16", 1, 384, 384, 2, False),
           ("bf16", 8, 197, 197, 12, False)]   # (the last: 192 Q tiles on 132 CTAs)
S31_BWD = [("bf16", 1, 512, 512, 2, True), ("fp16", 1, 113, 301, 2, True)]


def s31_configs():
    fam, b = registry.get("sm90_fwd"), registry.get("sm90_bwd")
    out = []
    for dtype, bb, sq, sk, h, causal in S31_FWD:
        p = Problem("fwd", dtype, bb, sq, sk, h, h, 64, causal)
        out += [fam.for_problem(fam.heuristic(p, _gpu.arch()), p), main_fwd_config(fam, p)]
    for dtype, bb, sq, sk, h, causal in S31_BWD:
        p = Problem("bwd", dtype, bb, sq, sk, h, h, 64, causal)
        hb = b.for_problem(b.heuristic(p, _gpu.arch()), p)
        out += [hb, hb.replace(wide_epi=False)]
    return list(dict.fromkeys(out))


def main():
    api.POISON_OUTPUTS = True
    if "--s31" in sys.argv:
        if "--precompile" in sys.argv:
            from cuflash.compile import precompile

            todo = s31_configs()
            print([(c.name, e) for c, _, e in precompile(todo) if e] or f"{len(todo)} kernels compiled", flush=True)
            return
        quick = "--quick" in sys.argv
        if "--fp16" in sys.argv:   # the fp16 kernels --quick leaves to memcheck: causal forward and backward, BN 112
            s31_fwd_part([S31_FWD[3], S31_FWD[5], S31_FWD[10]])
            bwd_part(S31_BWD[1:])
        else:
            s31_fwd_part(S31_FWD[:3] if quick else S31_FWD)
            bwd_part(S31_BWD[:1] if quick else S31_BWD)
        print("short_seq sanitize done")
        return
    if "--rest" in sys.argv:
        # the default kernels --quick leaves to memcheck alone: fp16's non-causal backward (q_rotate, wide_epi) and
        # the forward BNs 144 / 160 / 176 in both dtypes
        if "--precompile" in sys.argv:
            from cuflash.compile import precompile

            b, f = registry.get("sm90_bwd"), registry.get("sm90_fwd")
            pb = Problem("bwd", "fp16", 1, 197, 197, 2, 2, 64, False)
            hb = b.for_problem(b.heuristic(pb, _gpu.arch()), pb)
            todo = [hb, hb.replace(wide_epi=False)]
            for dt in ("bf16", "fp16"):
                pf = Problem("fwd", dt, 1, 197, 197, 2, 2, 64, False)
                hf = f.for_problem(f.heuristic(pf, _gpu.arch()), pf)
                todo += [hf] + [hf.replace(BN=bn) for bn in SHORT_BNS[2:]]
            print([(c.name, e) for c, _, e in precompile(todo) if e] or f"{len(todo)} kernels compiled", flush=True)
            return
        bwd_part([("fp16", 1, 197, 197, 2, False)])
        fwd_part([("bf16", 1, 197, 197, 2, False), ("fp16", 1, 197, 197, 2, False)], SHORT_BNS[2:])
        print("short_seq sanitize done")
        return
    quick = "--quick" in sys.argv
    bwd = [("bf16", 1, 197, 197, 2, False), ("fp16", 1, 113, 301, 2, True)]
    if not quick:
        bwd += [("bf16", 1, 197, 197, 80, False)]    # 160 K/V tiles on 132 CTAs
    bwd_part(bwd[:1] if quick else bwd)
    fwd_part([("bf16", 1, 197, 197, 2, False)] + ([] if quick else [("fp16", 1, 301, 113, 2, True)]),
             SHORT_BNS[:2] if quick else SHORT_BNS)
    packed_part([(1, 197, 2, False)] + ([] if quick else [(2, 113, 3, True)]))
    print("short_seq sanitize done")


if __name__ == "__main__":
    main()
