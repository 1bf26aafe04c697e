"""Fused MLP timing (not a test): cuflash.modules.mlp.FusedMLP against the plain torch composition
nn.Linear → F.gelu(approximate='tanh') → nn.Linear, the same weights, in one process, bf16.

Per shape (tokens, in, hidden): forward in training mode (the pre-activation kept), forward +
backward, the inference forward (no_grad, eval: fc1's cuBLASLt GELU epilogue; heuristic -1: F.linear +
dense_act.cu instead), the peak memory of a training step above the inputs, and checkpoint_lvl 1 / 2
and relu / sqrelu at one shape. Peers of one comparison are interleaved call by call (the order
rotating each repeat), so clock and temperature drift fall on all of them alike; CUDA events around
each call, warm-up first, median and min. The element-wise kernels alone against torch's ops, with
CTAS_PER_SM variants. Host time: microseconds per eager call at 64 tokens (synchronized once after
the loop), and a cProfile of the fused calls (--profile FILE). --gpt: GPT-2 small training steps
with config.fused_mlp (and fused_bias_fc) on and off.

    python tests/fused_mlp_timing.py --out fused_mlp.json [--reps 30] [--profile host.txt] [--gpt]
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from cuflash import dense_act
from cuflash.modules.mlp import FusedMLP
from cuflash.ops import fused_dense

SHAPES = {   # name: (tokens, in_features, hidden_features)
    "gpt2s_8k": (8192, 768, 3072), "gpt2s_16k": (16384, 768, 3072),
    "1.3b_8k": (8192, 2048, 8192), "1.3b_16k": (16384, 2048, 8192),
    "llama7b_8k": (8192, 4096, 11008), "llama7b_16k": (16384, 4096, 11008),
}


class TorchMLP(nn.Module):
    def __init__(self, n_in, hidden, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(n_in, hidden), nn.Linear(hidden, n_in), act

    def forward(self, x):
        h = self.fc1(x)
        if self.act == "gelu_approx":
            h = F.gelu(h, approximate="tanh")
        elif self.act == "relu":
            h = F.relu(h)
        else:
            h = torch.square(F.relu(h))
        return self.fc2(h)


def timed(fns: dict, reps, warmup=3):
    """{name: {median_ms, min_ms}}: the calls interleaved, the order rotating each repeat."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    ms = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[n]()
            b.record()
            b.synchronize()
            ms[n].append(a.elapsed_time(b))
    return {n: {"median_ms": statistics.median(v), "min_ms": min(v)} for n, v in ms.items()}


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def make(n_in, hidden, act="gelu_approx", lvl=0, heuristic="auto"):
    torch.manual_seed(0)
    ref = TorchMLP(n_in, hidden, act).cuda().to(torch.bfloat16)
    fused = FusedMLP(n_in, hidden, activation=act, checkpoint_lvl=lvl, heuristic=heuristic, device="cuda",
                     dtype=torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def train_fns(model, x, dy):
    def fwd():
        model(x)

    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).backward(dy)
    return fwd, step


def forced(fn):
    """fn with the fused path forced (fused_dense.FUSED_MIN_ELEMENTS 0 during the call)."""
    def run():
        default = fused_dense.FUSED_MIN_ELEMENTS
        fused_dense.FUSED_MIN_ELEMENTS = 0
        try:
            fn()
        finally:
            fused_dense.FUSED_MIN_ELEMENTS = default
    return run


def peak_mb(step):
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def gpt2_small_steps(reps) -> dict:
    """GPT-2 small (cuflash.models.gpt, gelu_new, bf16, batch 8 x 1024, cuflash attention) training
    steps with config.fused_mlp (FusedMLP) and without (Mlp: nn.Linear + tanh GELU), the same weights,
    interleaved; the switches fused_bias_fc on / off ride along (FusedDense projections)."""
    from cuflash.models.gpt import GPT2Config, GPTLMHeadModel

    def model(**kw):
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                         pad_vocab_size_multiple=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         activation_function="gelu_new", use_flash_attn=True, **kw)
        torch.manual_seed(0)
        return GPTLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16)

    models = {"plain": model(), "fused_mlp": model(fused_mlp=True),
              "fused_mlp_bias_fc": model(fused_mlp=True, fused_bias_fc=True), "fused_mlp_lvl1": model(
                  fused_mlp=True, mlp_checkpoint_lvl=1)}
    for m in models.values():
        m.load_state_dict(models["plain"].state_dict())
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    labels = torch.randint(0, 50257, (8, 1024), device="cuda")
    losses = {}

    def step(name):
        def run():
            m = models[name]
            m.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(ids).logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            losses[name] = loss
        return run

    out = timed({n: step(n) for n in models}, max(10, reps // 2))
    for n, v in out.items():
        v["loss"] = losses[n].item()
    print("gpt2_small", json.dumps({n: [round(v["median_ms"], 3), round(v["loss"], 5)] for n, v in out.items()}),
          flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--profile", default="")
    ap.add_argument("--gpt", action="store_true", help="also GPT-2 small training steps, fused_mlp on / off")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernels-alone and host sections")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bf16", "rows": {}}
    for name in args.shapes.split(","):
        tokens, n_in, hidden = SHAPES[name]
        ref, fused = make(n_in, hidden)
        _, fused_h1 = make(n_in, hidden, heuristic=-1)
        x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
        tf, ts = train_fns(ref, x, dy)
        ff, fs = train_fns(fused, x, dy)
        # "fused": the default routing (fused_dense.FUSED_MIN_ELEMENTS); "fused_kernel": the fused path forced
        kf, ks = forced(ff), forced(fs)
        row = {}
        row.update({f"{k}_fwd": v for k, v in timed({"torch": tf, "fused": ff, "fused_kernel": kf}, args.reps).items()})
        steps = {"torch": ts, "fused": fs, "fused_kernel": ks}
        if name == "1.3b_16k":
            for lvl in (1, 2):
                steps[f"fused_lvl{lvl}"] = train_fns(make(n_in, hidden, lvl=lvl)[1], x, dy)[1]
        row.update({f"{k}_fwdbwd": v for k, v in timed(steps, args.reps).items()})
        for k, step in steps.items():
            row[f"{k}_peak_mb"] = peak_mb(step)
        for m in (ref, fused, fused_h1):
            m.eval()
        with torch.no_grad():
            inf = timed({"torch": lambda: ref(x), "fused": lambda: fused(x), "fused_h-1": lambda: fused_h1(x)},
                        args.reps)
        row.update({f"{k}_infer": v for k, v in inf.items()})
        if name in ("1.3b_16k", "llama7b_16k"):
            acts = {}
            for act in ("relu", "sqrelu"):
                r2, f2 = make(n_in, hidden, act=act)
                acts[f"torch_{act}"] = train_fns(r2, x, dy)[1]
                acts[f"fused_{act}"] = train_fns(f2, x, dy)[1]
                acts[f"fused_kernel_{act}"] = forced(train_fns(f2, x, dy)[1])
            row.update({f"{k}_fwdbwd": v for k, v in timed(acts, args.reps).items()})
        res["rows"][name] = row
        print(name, json.dumps({k: (round(v["median_ms"], 4) if isinstance(v, dict) else round(v, 1))
                                for k, v in row.items()}), flush=True)
    # the element-wise kernels alone against torch's ops on the same (tokens, hidden) bf16 matrices:
    # forward act(pre) vs F.gelu(tanh); backward dpre + dbias vs gelu_backward + sum(0); CTAS_PER_SM variants
    if args.no_kernels:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    kern = {}
    default = dense_act.CTAS_PER_SM

    def with_ctas(c, fn):
        def run():
            dense_act.CTAS_PER_SM = c
            fn()
        return run

    for tokens, hidden in ((16384, 3072), (16384, 8192), (16384, 11008)):
        pre = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        gb = 2 * tokens * hidden / 1e9   # GB of one (tokens, hidden) bf16 matrix
        fwd = {"torch_fwd": lambda: F.gelu(pre, approximate="tanh")}
        bwd = {"torch_bwd": lambda: torch.ops.aten.gelu_backward(g, pre, approximate="tanh").sum(0)}
        for c in (8,):
            fwd[f"fwd_c{c}"] = with_ctas(c, lambda: dense_act.forward(pre, "gelu_approx"))
            bwd[f"bwd_c{c}"] = with_ctas(c, lambda: dense_act.backward(g, pre, "gelu_approx", True))
        k = {**timed(fwd, args.reps), **timed(bwd, args.reps)}
        dense_act.CTAS_PER_SM = default
        for key, v in k.items():   # fwd: pre read, out written; bwd: g, pre read, dpre written
            v["tb_s"] = (2 if "fwd" in key else 3) * gb / v["median_ms"]
        kern[f"{tokens}x{hidden}"] = k
        print("kernels", tokens, hidden, json.dumps({key: [round(v["median_ms"], 4), round(v["tb_s"], 2)]
                                                      for key, v in k.items()}), flush=True)
    res["kernels"] = kern
    if args.gpt:
        res["gpt2_small"] = gpt2_small_steps(args.reps)
    # host time per eager call, 64 tokens of GPT-2 small
    ref, fused = make(768, 3072)
    x = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    host = {}
    for tag, model in (("torch", ref), ("fused", fused)):
        fwd, step = train_fns(model, x, dy)
        host[f"{tag}_fwd_us"] = host_us(fwd)
        host[f"{tag}_fwdbwd_us"] = host_us(step)
    fwd, step = train_fns(fused, x, dy)
    host["fused_kernel_fwd_us"] = host_us(forced(fwd))
    host["fused_kernel_fwdbwd_us"] = host_us(forced(step))
    for tag, model in (("torch", ref), ("fused", fused)):
        model.eval()
        with torch.no_grad():
            host[f"{tag}_infer_us"] = host_us(lambda: model(x))
    res["host_64_tokens"] = host
    print("host", json.dumps({k: round(v, 1) for k, v in host.items()}), flush=True)
    if args.profile:
        fused.train()
        step = forced(train_fns(fused, x, dy)[1])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
