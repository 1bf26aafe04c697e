"""Where the host time of an eager forward + backward goes (issue 12, session 30), on small
(host-bound) CUDA tensors, every variant interleaved in rounds in one process
(cuflash.timing.host_us_interleaved; speed is reported, never asserted):

* the norms: ``rms_norm_fn`` / ``layer_norm_fn`` (8 x 2048 bf16; RMSNorm also with a residual)
  against ``F.rms_norm`` / ``F.layer_norm``: ``fwd`` (nothing to differentiate), ``fwdgrad`` (the
  forward autograd records, no backward), ``fwdbwd`` (forward + ``torch.autograd.grad``);
  variants of cuflash's: ``main`` (main's fast path before session 30: the public
  ``autograd.Function.apply`` and the backward's partials allocated apart); of RMSNorm:
  ``pubapply`` (``_EntryNormFn.apply``, the public ``autograd.Function.apply``, instead of the raw
  C apply), ``nolaunch`` (the plans' launches
  stubbed: what the launches cost the host; the outputs are garbage);
* probes of autograd itself: ``null`` (a Python ``autograd.Function`` that allocates its outputs
  and nothing else, raw and public apply; the same as a ``torch.library.custom_op`` with
  ``register_autograd``) against ``mul`` (``x * w``: one C++ node);
  ``bodyfwd`` / ``bodybwd``: ``Entry.forward`` / ``Entry.backward`` called directly, outside
  autograd (the Python bodies with their allocations and launches); ``empty``: one
  ``torch.empty_like`` of x;
* attention: ``flash_attn_func(q, k, v, causal=True)`` on 1 x 128 x 4 x 64 bf16 against SDPA's
  flash and cuDNN backends (pinned), ``fwd`` and ``fwdbwd`` (``autograd.grad`` with a dout).

Then, per fwdbwd case, timestamps around one call: from ``autograd.grad``'s call to the
backward's entry (the engine's hand-off to its device thread), the backward's own time, and
from its exit to ``autograd.grad``'s return (medians of --stamps calls; torch's C++ nodes are
stamped by Python hooks, which add their own cost).

    python tests/autograd_host_breakdown.py [--out breakdown.json] [--calls 200] [--rounds 9]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

from cuflash import layer_norm as ln
from cuflash import torch_ops
from cuflash.api import flash_attn_func
from cuflash.ops import layer_norm as ops
from cuflash.timing import host_us_interleaved

EPS = 1e-6


@contextlib.contextmanager
def swap(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def as_main():
    """main's fast path before session 30 (20db2ea): the public autograd.Function.apply, and the
    backward's partials allocated apart (every entry's statistics 2 · rows floats)."""
    olds = {e: e.stats_len for e in ln.entries.values()}
    for e in olds:
        e.stats_len = 2 * e.rows
    try:
        with swap(ops, "_entry_apply", None):
            yield
    finally:
        for e, v in olds.items():
            e.stats_len = v


@contextlib.contextmanager
def no_launch():
    """Every norm plan's launches stubbed (RecordPlan.launch)."""
    plans = list(ln._plans.values())
    olds = [p.launch for p in plans]
    for p in plans:
        p.launch = lambda *a: None
    try:
        yield
    finally:
        for p, f in zip(plans, olds):
            p.launch = f


class Null(torch.autograd.Function):
    """Allocates its outputs, nothing else (the Python autograd.Function's own cost)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.set_materialize_grads(False)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


_null_raw = torch._C._FunctionBase.__dict__["apply"].__get__(None, Null)


@torch.library.custom_op("cuflash_probe::null", mutates_args=())
def null_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Null as a torch.library.custom_op with register_autograd (the other way to give an op a
    backward)."""
    return torch.empty_like(x)


@null_op.register_fake
def _(x, w):
    return torch.empty_like(x)


def _null_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _null_bwd(ctx, dy):
    x, w = ctx.saved_tensors
    return torch.empty_like(x), torch.empty_like(w)


null_op.register_autograd(_null_bwd, setup_context=_null_setup)


def table(rows, n, dt):
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    x, r, dy = rnd(rows, n), rnd(rows, n), rnd(rows, n)
    w, b = 1 + 0.1 * rnd(n), 0.1 * rnd(n)
    xg, wg, bg, rg = (t.clone().requires_grad_(True) for t in (x, w, b, r))
    grad = torch.autograd.grad
    none = contextlib.nullcontext
    out = {
        "fwd rms cuflash": (lambda: ops.rms_norm_fn(x, w, None, eps=EPS), none),
        "fwd rms torch": (lambda: F.rms_norm(x, (n,), w, EPS), none),
        "fwdgrad rms cuflash": (lambda: ops.rms_norm_fn(xg, wg, None, eps=EPS), none),
        "fwdgrad rms cuflash pubapply": (lambda: ops.rms_norm_fn(xg, wg, None, eps=EPS),
                                         lambda: swap(ops, "_entry_apply", None)),
        "fwdgrad rms torch": (lambda: F.rms_norm(xg, (n,), wg, EPS), none),
        "fwdbwd rms cuflash": (lambda: grad(ops.rms_norm_fn(xg, wg, None, eps=EPS), (xg, wg), dy), none),
        "fwdbwd rms cuflash pubapply": (lambda: grad(ops.rms_norm_fn(xg, wg, None, eps=EPS), (xg, wg), dy),
                                        lambda: swap(ops, "_entry_apply", None)),
        "fwdbwd rms cuflash nolaunch": (lambda: grad(ops.rms_norm_fn(xg, wg, None, eps=EPS), (xg, wg), dy),
                                        no_launch),
        "fwdbwd rms cuflash main": (lambda: grad(ops.rms_norm_fn(xg, wg, None, eps=EPS), (xg, wg), dy), as_main),
        "fwdbwd rms torch": (lambda: grad(F.rms_norm(xg, (n,), wg, EPS), (xg, wg), dy), none),
        "fwdbwd ln cuflash": (lambda: grad(ops.layer_norm_fn(xg, wg, bg, eps=EPS), (xg, wg, bg), dy), none),
        "fwdbwd ln cuflash main": (lambda: grad(ops.layer_norm_fn(xg, wg, bg, eps=EPS), (xg, wg, bg), dy), as_main),
        "fwdbwd ln torch": (lambda: grad(F.layer_norm(xg, (n,), wg, bg, EPS), (xg, wg, bg), dy), none),
        "fwdbwd rms_res cuflash": (lambda: grad(ops.rms_norm_fn(xg, wg, None, residual=rg, prenorm=True, eps=EPS)[0],
                                                (xg, wg, rg), dy), none),
        "fwdbwd rms_res cuflash main": (
            lambda: grad(ops.rms_norm_fn(xg, wg, None, residual=rg, prenorm=True, eps=EPS)[0], (xg, wg, rg), dy),
            as_main),
        "fwdbwd rms_res torch": (lambda: grad(F.rms_norm(xg + rg, (n,), wg, EPS), (xg, wg, rg), dy), none),
        "fwdgrad null raw": (lambda: _null_raw(xg, wg), none),
        "fwdgrad null pubapply": (lambda: Null.apply(xg, wg), none),
        "fwdgrad null custom_op": (lambda: null_op(xg, wg), none),
        "fwdgrad mul torch": (lambda: xg * wg, none),
        "fwdbwd null raw": (lambda: grad(_null_raw(xg, wg), (xg, wg), dy), none),
        "fwdbwd null pubapply": (lambda: grad(Null.apply(xg, wg), (xg, wg), dy), none),
        "fwdbwd null custom_op": (lambda: grad(null_op(xg, wg), (xg, wg), dy), none),
        "fwdbwd mul torch": (lambda: grad(xg * wg, (xg, wg), dy), none),
        "empty_like x": (lambda: torch.empty_like(x), none),
    }
    ops.rms_norm_fn(xg, wg, None, eps=EPS)   # makes the entries (as_main sees them)
    ops.layer_norm_fn(xg, wg, bg, eps=EPS)
    ops.rms_norm_fn(xg, wg, None, residual=rg, prenorm=True, eps=EPS)
    entry = next(e for e in ln.entries.values() if e.has_bias is False and e.has_residual is False)
    y, _, stats = entry.forward(x, w, None, None)
    entry.backward(dy, None, x, None, w, stats)
    out["bodyfwd rms"] = (lambda: entry.forward(x, w, None, None), none)
    out["bodybwd rms"] = (lambda: entry.backward(dy, None, x, None, w, stats), none)
    return out, (xg, wg, dy)


def attention_table():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (1, 128, 4, 64)
    rnd = lambda s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = (rnd(shape) for _ in range(4))
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    qtg, ktg, vtg = (t.clone().requires_grad_(True) for t in (qt, kt, vt))
    grad = torch.autograd.grad
    none = contextlib.nullcontext
    out = {
        "fwd attn cuflash": (lambda: flash_attn_func(q, k, v, causal=True), none),
        "fwdgrad attn cuflash": (lambda: flash_attn_func(qg, kg, vg, causal=True), none),
        "fwdbwd attn cuflash": (lambda: grad(flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), do), none),
    }
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        ctx = lambda be=be: sdpa_kernel(be)  # noqa: E731
        fwd = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
        fwdbwd = lambda: grad(F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True),  # noqa: E731
                              (qtg, ktg, vtg), dot)
        try:
            with ctx():
                fwd(), fwdbwd()
        except RuntimeError as exc:   # a backend this GPU / torch lacks: left out
            print(f"{name}: left out ({str(exc).splitlines()[0]})")
            continue
        out[f"fwd attn {name}"] = (fwd, ctx)
        out[f"fwdgrad attn {name}"] = (lambda: F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True), ctx)
        out[f"fwdbwd attn {name}"] = (fwdbwd, ctx)
    return out, (qg, kg, vg, do, qtg, ktg, vtg, dot)


def stamps(make_out, leaves, dy, calls, cls=None):
    """Medians (µs) of: call -> backward entry, backward, backward exit -> return; cls: a Python
    autograd.Function whose backward is wrapped, else the output's grad_fn gets Python hooks."""
    marks = []
    t = [0, 0, 0, 0]
    if cls is not None:
        real = cls.backward

        def wrapped(ctx, *grads):
            t[1] = time.perf_counter_ns()
            res = real(ctx, *grads)
            t[2] = time.perf_counter_ns()
            return res
        cls.backward = staticmethod(wrapped)
    try:
        for i in range(calls + 20):
            y = make_out()
            if cls is None:
                y.grad_fn.register_prehook(lambda go: t.__setitem__(1, time.perf_counter_ns()))
                y.grad_fn.register_hook(lambda gi, go: t.__setitem__(2, time.perf_counter_ns()))
            t[0] = time.perf_counter_ns()
            torch.autograd.grad(y, leaves, dy)
            t[3] = time.perf_counter_ns()
            if i >= 20:
                marks.append(((t[1] - t[0]) / 1e3, (t[2] - t[1]) / 1e3, (t[3] - t[2]) / 1e3))
    finally:
        if cls is not None:
            cls.backward = staticmethod(real)
    return [round(statistics.median(m[i] for m in marks), 2) for i in range(3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="breakdown.json")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--stamps", type=int, default=300)
    ap.add_argument("--no-attention", action="store_true")
    a = ap.parse_args()
    fns, (xg, wg, dy) = table(8, 2048, torch.bfloat16)
    attn = None
    if not a.no_attention:
        more, attn = attention_table()
        fns.update(more)
    res = host_us_interleaved(fns, calls=a.calls, rounds=a.rounds, sync=torch.cuda.synchronize)
    n = xg.shape[-1]
    st = {
        "rms cuflash": stamps(lambda: ops.rms_norm_fn(xg, wg, None, eps=EPS), (xg, wg), dy, a.stamps,
                              ops._EntryNormFn),
        "rms torch (hooked)": stamps(lambda: F.rms_norm(xg, (n,), wg, EPS), (xg, wg), dy, a.stamps),
        "null raw": stamps(lambda: _null_raw(xg, wg), (xg, wg), dy, a.stamps, Null),
        "mul torch (hooked)": stamps(lambda: xg * wg, (xg, wg), dy, a.stamps),
    }
    if attn is not None:
        qg, kg, vg, do, qtg, ktg, vtg, dot = attn
        st["attn cuflash"] = stamps(lambda: flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), do, a.stamps,
                                    torch_ops.FlashAttnFn)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            st["attn sdpa_flash (hooked)"] = stamps(
                lambda: F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True), (qtg, ktg, vtg), dot, a.stamps)
    torch.cuda.synchronize()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": a.calls, "rounds": a.rounds,
           "host_us": {k: {"best": round(v[0], 2), "median": round(v[1], 2)} for k, v in res.items()},
           "stamps_us": {k: dict(zip(("to_backward", "backward", "after_backward"), v)) for k, v in st.items()}}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['device']}, torch {out['torch']}; host us per call, best / median of {a.rounds} rounds of "
          f"{a.calls} calls (norms 8x2048 bf16, attention 1x128x4x64 bf16 causal)")
    for k, v in out["host_us"].items():
        print(f"{k:34s} {v['best']:8.2f} {v['median']:8.2f}")
    print(f"stamps, medians of {a.stamps} calls (us): call -> backward entry, backward, exit -> return")
    for k, v in out["stamps_us"].items():
        print(f"{k:34s} {v['to_backward']:8.2f} {v['backward']:8.2f} {v['after_backward']:8.2f}")


if __name__ == "__main__":
    main()
