"""Host time of the feature calls' Python without a GPU (issue 12): flash_attn_func with a window,
softcap, ALiBi or dropout and flash_attn_varlen_func on torch CPU tensors described as CUDA ones, the
plans faked (a launch records nothing), the fast route (the cached call shapes: cuflash.torch_ops.
features_attention, cuflash.varlen_torch.fast_attention) against the validating route it skips
(cuflash.api._features_func; not for dropout and varlen, whose validating routes need the GPU:
torch ops, the reference), interleaved in rounds, CPU time per call. What it measures is the Python a call runs; the CUDA caching allocator, the real
launches and autograd on CUDA tensors add their own (tests/features_host_timing.py on a GPU).

    PYTHONPATH=$PWD python tests/features_host_profile.py [--calls 2000] [--profile CASE]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

import cuflash
from cuflash import api, torch_ops, varlen, varlen_torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_host_profile import per_call_us  # noqa: E402  (CPU time per call)


class FakePlan:
    """A plan that records its launches (kind, pointers, workspace, per-call fields); keep=False:
    counts them only."""
    device, workspace_bytes, keep = 0, 64, True

    def __init__(self, problem, made):
        self.problem, self.launches, self.count = problem, [], 0
        made.append(self)

    def _record(self, kind, ptrs, ws, fields):
        self.count += 1
        if self.keep:
            self.launches.append((kind, ptrs, ws, tuple(fields)))

    def run(self, ptrs, ws, stream):
        self._record("run", ptrs, ws, ())

    def run_with(self, ptrs, ws, stream, extra):
        self._record("run_with", ptrs, ws, extra)

    def run_fields(self, fields, ptrs, ws, stream):
        self._record("run_fields", ptrs, ws, fields.items())

    def run_varlen(self, ptrs, ws, stream, cu_q, cu_k):
        self._record("run_varlen", ptrs, ws, (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)))


def stub_gpu(monkeypatch_attr=setattr) -> list:
    """torch CPU tensors described as on CUDA device 0, the plans faked, the plan caches fresh:
    returns the list of the plans made."""
    made = []
    describe, device_of = api.describe, api._device_of

    def fake_describe(name, x):
        t = describe(name, x)
        return api._Tensor(t.kind, t.dtype, t.shape, t.strides, x.data_ptr(), 0) \
            if t.kind == "torch" else t

    monkeypatch_attr(api, "describe", fake_describe)
    monkeypatch_attr(api, "_device_of", lambda x, kind: 0 if kind == "torch" else device_of(x, kind))
    # (its lse check reads lse's device itself: the descriptions only)
    monkeypatch_attr(api, "check_bwd_tensors", lambda tq, dout, out, lse: (
        api.describe("dout", dout), api.describe("out", out)))
    monkeypatch_attr(api, "make_plan", lambda problem, strides, scale, device, config=None:
                     FakePlan(problem, made))
    monkeypatch_attr(torch_ops, "_raw_stream", lambda device: 0)
    monkeypatch_attr(varlen_torch, "_raw_stream", lambda device: 0)
    for mod, name in ((api, "_feature_plans"), (torch_ops, "_feat_plans"), (torch_ops, "_drop_fwd_plans"),
                      (torch_ops, "_drop_bwd_plans"), (torch_ops, "_fwd_plans"), (torch_ops, "_bwd_plans"),
                      (varlen, "_plans"), (varlen, "_feature_plans"), (varlen_torch, "_fast_plans")):
        monkeypatch_attr(mod, name, {})
    return made


CASES = {"window": dict(window_size=(64, 0)), "softcap": dict(softcap=30.0),
         "alibi": dict(alibi=True), "dropout": dict(dropout_p=0.1), "varlen": dict(varlen=True),
         "varlen_window": dict(varlen=True, window_size=(32, 0))}


def calls(case: str, fwdbwd: bool):
    """{route: fn} of one case: 'fast' (flash_attn_func / flash_attn_varlen_func) and
    'validating' (the route the fast one skips)."""
    kw = dict(CASES[case])
    h, d = 4, 64
    g = torch.Generator().manual_seed(0)
    varlen_call = kw.pop("varlen", False)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(h, generator=g)
    shape = (128, h, d) if varlen_call else (1, 128, h, d)
    q, k, v = (torch.randn(*shape, generator=g).to(torch.bfloat16).requires_grad_(fwdbwd)
               for _ in range(3))
    dout = torch.randn(*shape, generator=g).to(torch.bfloat16)
    if varlen_call:
        cu = torch.tensor([0, 60, 88, 128], dtype=torch.int32)
        fast = lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 60, 60, causal=True, **kw)  # noqa: E731

        slow = None  # (the validating route launches through torch ops: CUDA kernels only)
    else:
        fast = lambda: cuflash.flash_attn_func(q, k, v, causal=True, **kw)  # noqa: E731
        args = (kw.get("dropout_p", 0.0), None, True, kw.get("window_size", (-1, -1)),
                kw.get("softcap", 0.0), kw.get("alibi_slopes"), False, False, None, None)
        # (dropout's validating route runs torch CPU tensors on the float64 reference)
        slow = None if "dropout_p" in kw else lambda: api._features_func(q, k, v, *args)  # noqa: E731
    fns = {"fast": fast} if slow is None else {"fast": fast, "validating": slow}
    if not fwdbwd:
        return fns
    return {name: (lambda fn=fn: fn().backward(dout)) for name, fn in fns.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--profile", help="CASE:PASS (e.g. window:fwdbwd): cProfile of the fast route")
    a = ap.parse_args(argv)
    stub_gpu()
    FakePlan.keep = False
    print("| case | pass | fast µs | validating µs |\n| --- | --- | --- | --- |")
    for case in a.cases:
        for fwdbwd in (False, True):
            fns = calls(case, fwdbwd)
            per = {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(a.rounds):
                for name, fn in fns.items():
                    per[name].append(per_call_us(fn, a.calls))
            med = {name: f"{sorted(v)[len(v) // 2]:.1f}" for name, v in per.items()}
            print(f"| {case} | {'fwdbwd' if fwdbwd else 'fwd'} | {med['fast']} | "
                  f"{med.get('validating', '-')} |", flush=True)
    if a.profile:
        case, pass_ = a.profile.split(":")
        fn = calls(case, pass_ == "fwdbwd")["fast"]
        fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            fn()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
