"""--mode features: sliding window, softcap and ALiBi against the same call without the feature
and against SDPA.

For each head dim (default 128) and seqlen (default 8k) of the FlashAttention convention
(heads = 2048 / head dim, batch · seqlen = 16k), bf16 unless told otherwise, and each case:
  window1024_causal  window_size=(1024, 0) (Mistral-style local causal attention)
  window1024         window_size=(1024, 1024)
  softcap30          softcap=30 (Gemma 2), with and without causal
  alibi              ALiBi slopes (nheads,) (BLOOM / MPT), with and without causal
the forward ("fwd") and forward + backward ("fwdbwd", torch autograd) of:
  cuflash            flash_attn_func with the feature (selection's family)
  cuflash_plain      the same call without the feature (same causal flag)
  sdpa_math, sdpa_efficient, sdpa_cudnn   SDPA with the feature as an explicit attn_mask (a
                     boolean band, or ALiBi's float bias with the causal -inf folded in);
                     softcap has no SDPA form (recorded as an error)
  sdpa_flash         SDPA's flash backend without the feature (it takes no mask)
timed interleaved in one process on the same tensors (cuflash.timing). Records: impl, case,
op, dtype, hdim, seqlen, batch, nheads, ms, spread (or error), and x_plain = ms /
cuflash_plain's ms. Writes results/<gpu>/bench_features.{json,csv}; prints one table.
"""
from __future__ import annotations

from .. import _gpu
from ..problem import Problem
from .common import inputs, measure, release, results_dir, short, write

STEM = "bench_features"
SEQLENS = (8192,)
HDIMS = (128,)
OPS = ("fwd", "fwdbwd")
CASES = {
    "window1024_causal": dict(causal=True, window_size=(1024, 0)),
    "window1024": dict(causal=False, window_size=(1024, 1024)),
    "softcap30": dict(causal=False, softcap=30.0),
    "softcap30_causal": dict(causal=True, softcap=30.0),
    "alibi": dict(causal=False, alibi=True),
    "alibi_causal": dict(causal=True, alibi=True),
}
SDPA_MASKED = ("sdpa_math", "sdpa_efficient", "sdpa_cudnn")


def alibi_slopes(nheads: int, device="cpu"):
    """The ALiBi paper's slopes for nheads heads (a power of two): 2^(-8 i / nheads), i = 1.."""
    import torch

    return torch.tensor([2.0 ** (-8.0 * (i + 1) / nheads) for i in range(nheads)],
                        dtype=torch.float32, device=device)


def sdpa_mask(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1), slopes=None,
              dtype=None, device="cpu"):
    """SDPA's attn_mask for a case, bottom-right aligned as cuflash: None (no feature), a
    boolean (s_q, s_k) keep mask (causal / window), or with ALiBi a float (1, h, s_q, s_k)
    bias with -inf at the hidden elements."""
    import torch

    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + seqlen_k - seqlen_q
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    if slopes is None:
        return keep if (causal or window != (-1, -1)) else None
    bias = -slopes[:, None, None].to(torch.float32) * (diag - j).abs()[None].to(torch.float32)
    bias = bias.masked_fill(~keep[None], float("-inf"))
    return bias[None].to(dtype or torch.float32)


def _sdpa(impl: str, mask, causal: bool):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from .common import sdpa_backend

    backend = sdpa_backend(impl)

    def f(q, k, v):
        with sdpa_kernel(backend):
            if mask is None:
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                     v.transpose(1, 2), is_causal=causal)
            else:
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                     v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2)
    return f


def _cuflash(**kw):
    from ..api import flash_attn_func

    return lambda q, k, v: flash_attn_func(q, k, v, **kw)


def _timed(f, op: str, q, k, v, dout):
    """A callable of the forward alone, or forward + backward (autograd) of f."""
    import torch

    if op == "fwd":
        return lambda: f(q, k, v)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return lambda: torch.autograd.backward(f(*leaves), dout)


def run(hdims=HDIMS, seqlens=SEQLENS, dtypes=("bf16",), cases=tuple(CASES), ops=OPS,
        out="results", reps=10, flush_l2=False, log=print) -> list:
    _gpu.require("bench --mode features")
    import torch

    records = []
    for dtype in dtypes:
        for d in hdims:
            for s in seqlens:
                for case in cases:
                    kw = dict(CASES[case])
                    causal = kw["causal"]
                    p = Problem.fa_convention("fwd", dtype, d, causal, s)
                    q, k, v, dout = inputs(p, 4)
                    slopes = alibi_slopes(p.nheads, q.device) if kw.pop("alibi", False) else None
                    feature_kw = dict(kw, alibi_slopes=slopes) if slopes is not None else kw
                    fns, errors = {}, {}
                    impls = {"cuflash": _cuflash(**feature_kw), "cuflash_plain": _cuflash(causal=causal),
                             "sdpa_flash": _sdpa("sdpa_flash", None, causal)}
                    mask = None
                    try:
                        mask = sdpa_mask(s, s, causal, kw.get("window_size", (-1, -1)), slopes,
                                         q.dtype, q.device)
                    except Exception as exc:  # noqa: BLE001 - e.g. out of memory
                        errors.update({i: short(exc) for i in SDPA_MASKED})
                    for impl in SDPA_MASKED:
                        if kw.get("softcap"):
                            errors[impl] = "SDPA has no softcap"
                        elif impl not in errors:
                            impls[impl] = _sdpa(impl, mask, causal)
                    for op in ops:
                        fns = {impl: _timed(f, op, q, k, v, dout) for impl, f in impls.items()}
                        timings = {**measure(fns, reps, flush_l2, log), **errors}
                        plain = timings.get("cuflash_plain")
                        base = dict(case=case, op=op, dtype=dtype, hdim=d, seqlen=s, batch=p.batch,
                                    nheads=p.nheads, causal=causal)
                        for impl, t in timings.items():
                            rec = dict(impl=impl, **base)
                            if isinstance(t, str):
                                rec["error"] = t
                            else:
                                rec.update(ms=t.median_ms, spread=round(t.spread, 4))
                                if plain is not None and not isinstance(plain, str):
                                    rec["x_plain"] = round(t.median_ms / plain.median_ms, 3)
                            records.append(rec)
                        log(line(records[-len(timings):]))
                    del q, k, v, dout, mask, fns, impls
                    release()
                    torch.cuda.empty_cache()
    write(records, results_dir(out), STEM, None, log)
    log("\n" + table(records))
    return records


def line(recs: list) -> str:
    r0 = recs[0]
    cells = [f"{r['impl']} {r['ms']:.3f} ms" if "ms" in r else f"{r['impl']} -" for r in recs]
    return f"{r0['case']} {r0['op']} d{r0['hdim']} s{r0['seqlen']}: " + ", ".join(cells)


def table(records: list) -> str:
    """A markdown table: one row per (case, op, dtype, hdim, seqlen), ms per impl, and cuflash's
    time relative to the same call without the feature."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    rows = {}
    for r in records:
        key = (r["case"], r["op"], r["dtype"], r["hdim"], r["seqlen"])
        rows.setdefault(key, {})[r["impl"]] = r
    out = ["| case | op | dtype | d | seqlen | " + " | ".join(f"{i} ms" for i in impls)
           + " | cuflash / plain |", "|" + " --- |" * (6 + len(impls))]
    for key, by in rows.items():
        cells = [f"{by[i]['ms']:.3f}" if i in by and "ms" in by[i] else "-" for i in impls]
        ratio = by.get("cuflash", {}).get("x_plain")
        out.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells)
                   + f" | {ratio if ratio is not None else '-'} |")
    return "\n".join(out)
