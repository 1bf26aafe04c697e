"""Which schedule field breaks softcap's backward (GPU round 1: the softcap kernel with the plain call's fields,
dyn ds2 dqe dkl pin, gave dq errors of 0.015 where the reference is 0, at seqlen_q 17 / seqlen_k 1): per
subset of the fields, the gradients' max error against float64 and the low-precision baseline's, on a few
odd shapes. The softcap rule (feature_sched_built: the whole combination only) is lifted here. Not a test.

    timeout 60 python tests/bwd_feature_sched_diag.py
"""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import torch  # noqa: E402

import cuflash  # noqa: E402
from cuflash.compile import precompile  # noqa: E402
from cuflash.families import sm90_bwd  # noqa: E402

from test_features_gpu import feature_attention, grads, inputs  # noqa: E402

W = dict(dq_writer=True)
SUBSETS = {
    "heur": dict(W),
    "dyn": dict(W, dynamic=True),
    "ds2": dict(W, ds_double=True),
    "dqe": dict(W, dq_early=True),
    "dqe_dkl_pin": dict(W, dq_early=True, dk_late=True, frag_pin=True),
    "ds2_dqe_dkl_pin": dict(W, ds_double=True, dq_early=True, dk_late=True, frag_pin=True),
    "dyn_ds2": dict(W, dynamic=True, ds_double=True),
    "plain": dict(W, dynamic=True, ds_double=True, dq_early=True, dk_late=True, frag_pin=True),
    "dqb": dict(dq_bulk=True),
    "redadd": dict(),
}
SHAPES = [(17, 1, "mha"), (1, 17, "gqa"), (113, 1023, "mqa"), (1023, 113, "gqa")]


def main():
    # lift the softcap rule (the whole combination only) for the subsets
    orig = sm90_bwd.Sm90BwdConfig.feature_sched_built
    sm90_bwd.Sm90BwdConfig.feature_sched_built = lambda self: (
        orig(self.replace(ds_double=True, dq_early=True, dk_late=True, frag_pin=True)) if self.softcap else orig(self))
    cfgs = {}
    for causal in (False, True):
        for name, kw in SUBSETS.items():
            c = sm90_bwd.Sm90BwdConfig(64, 128, 2, 2, 128, "bf16", causal, softcap=True, **kw)
            if c.problems(227 * 1024):
                print(f"skip {name} {causal}: {c.problems(227 * 1024)}")
                continue
            cfgs[(name, causal)] = c
    cfgs[("s3_plain_nofeat", False)] = sm90_bwd.Sm90BwdConfig(64, 128, 3, 2, 128, "bf16", False, dq_writer=True,
                                                             ds_double=True, dq_early=True, dk_late=True, frag_pin=True)
    print("compile errors:", [(c.name, e) for c, _, e in precompile(list(cfgs.values())) if e], flush=True)
    torch.manual_seed(0)
    for (name, causal), cfg in cfgs.items():
        feat = not name.endswith("nofeat")
        cap = (5.0 if causal else 30.0) if feat else 0.0
        out = []
        for sq, sk, heads in SHAPES:
            q, k, v, dout = inputs(2, sq, sk, heads, 128, "bf16")
            kw = dict(causal=causal, softcap=cap)
            ours = grads(lambda q, k, v: cuflash.flash_attn_func(q, k, v, bwd_config=cfg, **kw), q, k, v, dout)
            ref = grads(lambda q, k, v: feature_attention(q, k, v, 128 ** -0.5, causal, (-1, -1), cap, None,
                                                          torch.float64)[0], q, k, v, dout.double())
            low = grads(lambda q, k, v: feature_attention(q, k, v, 128 ** -0.5, causal, (-1, -1), cap, None,
                                                          q.dtype)[0], q, k, v, dout)
            errs = []
            for a, r, b in zip(ours, ref, low):
                errs.append(f"{(a.double() - r).abs().max().item():.2g}/{(b.double() - r).abs().max().item():.2g}")
            out.append(f"{sq}x{sk}: " + " ".join(errs))
        print(f"{name:<16} {'causal' if causal else 'full':<6} {cfg.name}: " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
