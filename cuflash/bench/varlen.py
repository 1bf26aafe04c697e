"""Variable-length batches: the varlen kernels against the padded dense call, fwd and fwd+bwd.

One record per (impl, dtype, head dim, causal, length mix): a batch of sequences of mixed
lengths (a fixed, seeded draw), ``tokens`` real tokens in all, timed as
* "cuflash:varlen": flash_attn_varlen_func on the packed tokens (no padding computed);
* "cuflash:padded": flash_attn_func on the batch padded to the longest sequence (the work a
  dense call does for the same tokens; its outputs on the padding are thrown away);
* "sdpa:nested": torch SDPA on a nested (jagged) tensor of the same sequences, where this torch
  supports it (error recorded otherwise).
Forward alone and forward + backward (``torch.autograd.grad`` of the output). cu_seqlens are not read back
while timing (api.CHECK_CU_SEQLENS off: no sync per call). FLOPs count the
real tokens only, Σ_b 4·s_b²·h·d (÷2 causal; backward 2.5x), so TFLOPs compare the useful work.

``--features window softcap alibi dropout`` adds, per feature, the same records with that feature on both
cuflash calls (FEATURE_ARGS: window 256 left (non-causal also 256 right), softcap 30, ALiBi slopes per
head, dropout 0.1; no nested-tensor SDPA row), "feature" naming it ("" for the plain call); TFLOPs still
count the full attention of the real tokens (a window's visible share is smaller).

Run: ``python -m cuflash.bench.varlen [--out results] [--hdims 64 128] [--reps 20] [--features ...]``; writes
results/<gpu>/bench_varlen.{json,csv} (common.write) and prints one line per record.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

STEM = "bench_varlen"
MIXES = {  # name -> sequence lengths drawn in [lo, hi], until `tokens` tokens
    "short": (64, 1024),
    "mixed": (16, 4096),
    "long": (2048, 8192),
}


def lengths(mix: str, tokens: int, seed: int = 0) -> list:
    lo, hi = MIXES[mix]
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < tokens:
        out.append(int(min(rng.integers(lo, hi + 1), tokens - sum(out))))
    return out


def feature_args(feature: str, causal: bool, nheads: int) -> dict:
    """The keyword arguments of a cuflash call with this one feature ('' : none)."""
    import torch

    if feature == "window":
        return dict(window_size=(256, 0 if causal else 256))
    if feature == "softcap":
        return dict(softcap=30.0)
    if feature == "alibi":
        return dict(alibi_slopes=torch.tensor([2.0 ** (-8 * (i + 1) / nheads) for i in range(nheads)],
                                              device="cuda", dtype=torch.float32))
    if feature == "dropout":
        return dict(dropout_p=0.1)
    assert not feature, feature
    return {}


def flops(lens, nheads, head_dim, causal, bwd=False) -> float:
    f = sum(4.0 * s * s * nheads * head_dim for s in lens) / (2 if causal else 1)
    return f * (3.5 if bwd else 1.0)  # fwd + bwd = 1 + 2.5


def run_one(mix: str, dtype: str, head_dim: int, causal: bool, tokens: int = 16384,
            model_dim: int = 2048, reps: int = 20, log=print, feature: str = "") -> list:
    import torch

    import cuflash
    from ..timing import time_interleaved

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    h = max(1, model_dim // head_dim)
    lens = lengths(mix, tokens)
    b, smax = len(lens), max(lens)
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")
    q, k, v, do = (torch.randn(tokens, h, head_dim, device="cuda", dtype=tdt) for _ in range(4))
    pad = lambda x: torch.stack([torch.nn.functional.pad(x[cu[i]:cu[i + 1]],  # noqa: E731
                                                         (0, 0, 0, 0, 0, smax - lens[i]))
                                 for i in range(b)])
    qp, kp, vp, dop = (pad(x) for x in (q, k, v, do))
    for x in (q, k, v, qp, kp, vp):
        x.requires_grad_()

    # impl -> (forward callable, dout, the inputs the gradients are taken of)
    kw = feature_args(feature, causal, h)
    fns = {
        "cuflash:varlen": (lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, smax, smax, causal=causal, **kw),
                           do, (q, k, v)),
        "cuflash:padded": (lambda: cuflash.flash_attn_func(qp, kp, vp, causal=causal, **kw), dop, (qp, kp, vp)),
    }
    nested_error = "not timed with a feature" if feature else ""
    try:  # jagged nested tensors (B, j, h, d), seen by SDPA as (B, h, j, d)
        if feature:
            raise NotImplementedError(nested_error)
        offsets = cu.to(torch.int64)

        def nest(x, grad):
            # one offsets tensor for all: the same ragged size, so the output and its gradient
            # match (nested tensors built apart get different ragged sizes, j1 != j2)
            return torch.nested.nested_tensor_from_jagged(x.detach().clone(), offsets).requires_grad_(grad)
        qn, kn, vn = nest(q, True), nest(k, True), nest(v, True)
        don = nest(do, False).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        sdpa(t(qn), t(kn), t(vn), is_causal=causal)  # raises where unsupported
        fns["sdpa:nested"] = (lambda: sdpa(t(qn), t(kn), t(vn), is_causal=causal), don, (qn, kn, vn))
        nested_error = ""
    except Exception as exc:  # noqa: BLE001 - recorded
        nested_error = f"{type(exc).__name__}: {str(exc)[:160]}"

    def fwdbwd(f, dout, ins):
        return lambda: torch.autograd.grad(f(), ins, dout)

    records = []
    from .. import api

    check, api.CHECK_CU_SEQLENS = api.CHECK_CU_SEQLENS, False  # time the kernels, not a D2H sync
    try:
        with torch.no_grad():
            fwd_t = time_interleaved({n: f for n, (f, _, _) in fns.items()}, reps=reps)
        both_t = time_interleaved({n: fwdbwd(*fn) for n, fn in fns.items()}, reps=reps)
    finally:
        api.CHECK_CU_SEQLENS = check
    for name in fns:
        fm, bm = fwd_t[name].median_ms, both_t[name].median_ms
        records.append(dict(impl=name, mix=mix, dtype=dtype, hdim=head_dim, causal=causal, feature=feature,
                            nheads=h, tokens=tokens, batch=b, max_seqlen=smax,
                            padded_tokens=b * smax, fwd_ms=fm,
                            fwd_tflops=flops(lens, h, head_dim, causal) / fm / 1e9,
                            fwdbwd_ms=bm,
                            fwdbwd_tflops=flops(lens, h, head_dim, causal, True) / bm / 1e9))
    if nested_error:
        records.append(dict(impl="sdpa:nested", mix=mix, dtype=dtype, hdim=head_dim, causal=causal,
                            feature=feature, error=nested_error))
    for r in records:
        log("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash.bench.varlen")
    parser.add_argument("--out", default="results")
    parser.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES))
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--features", nargs="*", default=[],
                        help="also time each of these features on both calls (window softcap alibi dropout)")
    parser.add_argument("--no-plain", action="store_true", help="only the --features records")
    parser.add_argument("--causal", choices=["both", "0", "1"], default="both", help="the masks timed")
    args = parser.parse_args(argv)
    from .common import results_dir, write

    records = []
    feats = ([] if args.no_plain else [""]) + list(args.features)
    for mix in args.mixes:
        for d in args.hdims:
            for causal in {"both": (False, True), "0": (False,), "1": (True,)}[args.causal]:
                for feature in feats:
                    records += run_one(mix, args.dtype, d, causal, args.tokens, reps=args.reps, feature=feature)
    write(records, results_dir(args.out), STEM)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
