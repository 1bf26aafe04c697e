"""Host microseconds per eager call of the fused norms (cuflash.ops.layer_norm), cross entropy
(cuflash.ops.cross_entropy) and rotary (cuflash.layers.rotary.apply_rotary_emb) next to their torch
peers, on small (host-bound) CUDA tensors, interleaved in rounds in one process
(cuflash.timing.host_us_interleaved: CPU clock over many calls, the GPU drained between rounds).
Speed is reported, never asserted.

For each: the forward with nothing to differentiate (``fwd``) and forward + backward (``fwdbwd``:
the output's gradient through ``torch.autograd.grad``, no accumulation into ``.grad``); for RMSNorm
also the forward that autograd records, without its backward (``fwdgrad``). The norms
also run their checked route (``EAGER_CACHE = False``: the argument checks, the route and the plan
lookup of every call, as before the fast path) and torch's: ``F.rms_norm`` / ``F.layer_norm``, and
``x + r`` then ``F.rms_norm`` for the residual case.

    python tests/layer_norm_host_timing.py [--out host.json] [--calls 300] [--rounds 9]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from cuflash.layers import rotary
from cuflash.ops import cross_entropy as ce
from cuflash.ops import layer_norm as ops
from cuflash.timing import host_us_interleaved

EPS = 1e-6


class _Flag:
    """Sets ops.<name> = value around a timing (host_us_interleaved's context)."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        self.old = getattr(ops, self.name)
        setattr(ops, self.name, self.value)

    def __exit__(self, *exc):
        setattr(ops, self.name, self.old)


def _none():
    return _Flag("EAGER_CACHE", True)


def _checked():
    return _Flag("EAGER_CACHE", False)


def fns(rows, n, vocab, dt):
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s, dtype=dt: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    x, r, dy = rnd(rows, n), rnd(rows, n), rnd(rows, n)
    w, b = 1 + 0.1 * rnd(n), 0.1 * rnd(n)
    xg, wg, bg, rg = (t.clone().requires_grad_(True) for t in (x, w, b, r))
    logits, lg = rnd(rows, vocab), rnd(rows, vocab).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    dloss = torch.ones(rows, device="cuda")
    qk = rnd(1, rows, 8, 128)
    qkg = qk.clone().requires_grad_(True)
    ang = torch.rand(rows, 64, device="cuda", generator=g)
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    dq = rnd(1, rows, 8, 128)

    def grad(y, leaves, dy):
        return torch.autograd.grad(y, leaves, dy)

    nograd = {
        "rms": (lambda: ops.rms_norm_fn(x, w, None, eps=EPS), "torch_rms", lambda: F.rms_norm(x, (n,), w, EPS)),
        "ln": (lambda: ops.layer_norm_fn(x, w, b, eps=EPS), "torch_ln", lambda: F.layer_norm(x, (n,), w, b, EPS)),
        "rms_res": (lambda: ops.rms_norm_fn(x, w, None, residual=r, prenorm=True, eps=EPS), "torch_rms_res",
                    lambda: F.rms_norm(x + r, (n,), w, EPS)),
    }
    withgrad = {
        "rms": (lambda: grad(ops.rms_norm_fn(xg, wg, None, eps=EPS), (xg, wg), dy), "torch_rms",
                lambda: grad(F.rms_norm(xg, (n,), wg, EPS), (xg, wg), dy)),
        "ln": (lambda: grad(ops.layer_norm_fn(xg, wg, bg, eps=EPS), (xg, wg, bg), dy), "torch_ln",
               lambda: grad(F.layer_norm(xg, (n,), wg, bg, EPS), (xg, wg, bg), dy)),
        "rms_res": (lambda: grad(ops.rms_norm_fn(xg, wg, None, residual=rg, prenorm=True, eps=EPS)[0], (xg, wg, rg),
                                 dy), "torch_rms_res",
                    lambda: grad(F.rms_norm(xg + rg, (n,), wg, EPS), (xg, wg, rg), dy)),
    }
    fwdgrad = {   # the forward with autograd recording, no backward (fwdbwd - fwdgrad: the backward's share)
        "rms": (lambda: ops.rms_norm_fn(xg, wg, None, eps=EPS), "torch_rms", lambda: F.rms_norm(xg, (n,), wg, EPS)),
    }
    out = {}
    for kind, table in (("fwd", nograd), ("fwdgrad", fwdgrad), ("fwdbwd", withgrad)):
        for name, (fn, tname, tfn) in table.items():
            out[f"{kind} {name} cuflash"] = (fn, _none)
            out[f"{kind} {name} checked"] = (fn, _checked)
            out[f"{kind} {tname}"] = (tfn, _none)
    out["fwd cross_entropy cuflash"] = (lambda: ce.cross_entropy_loss(logits, labels)[0], _none)
    out["fwd torch_cross_entropy"] = (lambda: F.cross_entropy(logits, labels, reduction="none"), _none)
    out["fwdbwd cross_entropy cuflash"] = (lambda: grad(ce.cross_entropy_loss(lg, labels)[0], (lg,), dloss), _none)
    out["fwdbwd torch_cross_entropy"] = (lambda: grad(F.cross_entropy(lg, labels, reduction="none"), (lg,), dloss),
                                         _none)
    out["fwd rotary cuflash"] = (lambda: rotary.apply_rotary_emb(qk, cos, sin), _none)
    out["fwd torch_rotary"] = (lambda: rotary.apply_rotary_emb_torch(qk, cos, sin), _none)
    out["fwdbwd rotary cuflash"] = (lambda: grad(rotary.apply_rotary_emb(qkg, cos, sin), (qkg,), dq), _none)
    out["fwdbwd torch_rotary"] = (lambda: grad(rotary.apply_rotary_emb_torch(qkg, cos, sin), (qkg,), dq), _none)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="layer_norm_host.json")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    table = fns(a.rows, a.n, a.vocab, torch.bfloat16)
    res = host_us_interleaved(table, calls=a.calls, rounds=a.rounds, sync=torch.cuda.synchronize)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": a.rows, "n": a.n,
           "vocab": a.vocab, "dtype": "bf16", "calls": a.calls, "rounds": a.rounds,
           "host_us": {k: {"best": round(v[0], 2), "median": round(v[1], 2)} for k, v in res.items()}}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['device']}, torch {out['torch']}, bf16, norms {a.rows}x{a.n}, logits {a.rows}x{a.vocab}; "
          f"host us per call, best / median of {a.rounds} rounds of {a.calls} calls")
    for k, v in out["host_us"].items():
        print(f"{k:34s} {v['best']:8.2f} {v['median']:8.2f}")


if __name__ == "__main__":
    main()
