"""SHA-256 of every output of the feature paths' eager calls (issue 12's host-path work must not change
a bit): out, lse and, through torch autograd with deterministic=True, dq, dk, dv, of flash_attn_func
with a window, softcap, ALiBi ((nheads,) and (batch, nheads)), dropout (an explicit dropout_seed, and
torch's generator after torch.manual_seed) and their mix, and flash_attn_varlen_func, on inputs drawn
on the CPU from fixed seeds. Each call runs twice (a fresh call shape, then a repeat: the plan cache's
hit). Run it on two revisions and compare the JSON files. Not a test:

    timeout 60 python tests/features_bitwise_dump.py --out $RES/bitwise.json [--compare OTHER.json]
"""
import argparse
import hashlib
import json
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_here)]  # the checkout

CASES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(64, 0)),
    "window_sym": dict(window_size=(48, 32)),
    "softcap": dict(causal=True, softcap=30.0),
    "alibi": dict(causal=True, alibi="heads"),
    "alibi_batched": dict(alibi="batch"),
    "dropout_seed": dict(causal=True, dropout_p=0.17, dropout_seed=(1234, 5)),
    "dropout_gen": dict(causal=True, dropout_p=0.1, manual_seed=7),
    "mix": dict(causal=True, window_size=(80, 0), softcap=20.0, alibi="heads"),
    "mix_dropout": dict(window_size=(80, 16), alibi="heads", dropout_p=0.1, dropout_seed=99),
    "varlen": dict(causal=True, varlen=True),
    "varlen_window": dict(causal=True, varlen=True, window_size=(32, 0)),
    "varlen_alibi_softcap": dict(varlen=True, alibi="heads", softcap=25.0),
    "varlen_dropout": dict(causal=True, varlen=True, dropout_p=0.1, dropout_seed=3),
}
SHAPES = ((1, 128, 128, 4, 4, 64), (2, 333, 290, 4, 2, 64))  # b, s_q, s_k, h, h_kv, d
LENS = ((60, 28, 40), (200, 1, 0, 133))


def digest(x) -> str:
    import torch

    t = x.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def make_inputs(kw, shape_i):
    """(q, k, v, dout, cu, kw) of a case at SHAPES[shape_i] (varlen: LENS[shape_i]): CUDA bf16
    tensors requiring grad, drawn on the CPU from a fixed seed; cu the int32 offsets (varlen, else
    None); kw the call's keywords, alibi_slopes made for "alibi" ("heads": (nheads,), "batch":
    (batch, nheads)), "manual_seed" kept (call_once applies it)."""
    import torch

    kw = dict(kw)
    b, sq, sk, h, hkv, d = SHAPES[shape_i]
    g = torch.Generator().manual_seed(1000 + shape_i)
    alibi = kw.pop("alibi", None)
    cu = None
    if kw.pop("varlen", False):
        lens = LENS[shape_i]
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32,
                          device="cuda")
        shapes = ((sum(lens), h, d), (sum(lens), hkv, d))
        b = len(lens)
    else:
        shapes = ((b, sq, h, d), (b, sk, hkv, d))
    q = torch.randn(*shapes[0], generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(*shapes[1], generator=g).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(*shapes[0], generator=g).to("cuda", torch.bfloat16)
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(h, generator=g).to("cuda") * 0.3
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(b, h, generator=g).to("cuda") * 0.3
    return q, k, v, dout, cu, kw


def call_once(q, k, v, dout, cu, kw, shape_i) -> dict:
    """{name: tensor} of one call with deterministic=True: out, lse (not with dropout: S_dmask is
    a host-side computation), and torch autograd's dq, dk, dv for dout."""
    import torch

    import cuflash

    kw = dict(kw)
    manual = kw.pop("manual_seed", None)
    with_lse = "dropout_p" not in kw
    if manual is not None:
        torch.manual_seed(manual)
    if cu is not None:
        m = max(LENS[shape_i])
        r = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, m, m, deterministic=True,
                                           return_attn_probs=with_lse, **kw)
    else:
        r = cuflash.flash_attn_func(q, k, v, deterministic=True, return_attn_probs=with_lse, **kw)
    out, lse = (r[0], r[1]) if with_lse else (r, None)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {n: x for n, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))
            if x is not None}


def run_case(name, kw, shape_i):
    """[digests of the first call, digests of the repeat call] of a case."""
    q, k, v, dout, cu, kw = make_inputs(kw, shape_i)
    return [{n: digest(x) for n, x in call_once(q, k, v, dout, cu, kw, shape_i).items()}
            for _ in range(2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", help="another run's JSON: report every digest that differs")
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--parallel", action="store_true",
                    help="one worker process per case (compiles in parallel), results merged")
    args = ap.parse_args()
    results = {}
    if args.parallel:
        import subprocess
        import tempfile

        tmp = tempfile.mkdtemp()
        procs = {name: subprocess.Popen([sys.executable, __file__, "--cases", name, "--out",
                                         os.path.join(tmp, name + ".json")]) for name in args.cases}
        for name, p in procs.items():
            p.wait()
            try:
                with open(os.path.join(tmp, name + ".json")) as f:
                    results.update(json.load(f))
            except OSError:
                results[name] = {"error": f"worker rc {p.returncode}"}
    for name in args.cases if not args.parallel else ():
        for si in range(len(SHAPES)):
            key = f"{name}/{si}"
            try:
                first, repeat = run_case(name, CASES[name], si)
                results[key] = first
                if first != repeat:
                    print(f"{key}: the repeat call differs: {first} vs {repeat}")
            except Exception as exc:  # noqa: BLE001
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                print(f"{key}: {results[key]['error']}")
    print(f"{len(results)} calls digested", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)
        diff = [k for k in results if results[k] != other.get(k)]
        print(f"compare with {args.compare}: {len(results) - len(diff)} of {len(results)} equal"
              + (f"; differ: {diff}" if diff else ""))
        for k in diff:
            print(f"  {k}: {results[k]} vs {other.get(k)}")


if __name__ == "__main__":
    main()
