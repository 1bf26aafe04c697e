"""End-to-end check: train one small GPT with cuflash attention and with torch SDPA.

The same model (pre-LN GPT, causal, learned positions, tied embeddings), the same initial
weights (built on the CPU from one seed, then moved), the same batches in the same order
(each step's batch drawn from a CPU torch.Generator seeded with (seed, step)), bf16
autocast, AdamW. Only the attention call differs:

* cuflash: ``cuflash.flash_attn_func(q, k, v, causal=True)`` on (batch, seqlen, heads, 64)
  views of the fused qkv projection (strided, no copy), backward through cuflash's kernels;
* sdpa_*: ``F.scaled_dot_product_attention`` on the (batch, heads, seqlen, 64) transposes
  with ``is_causal=True``, pinned to one backend (flash, efficient, cuDNN or math).

The task (learnable, needs attention): each sequence is a random walk of period P (8..32)
on a fixed sparse graph (4 successors per token), repeated to fill the sequence. Within the
first period the next token is only predictable to ln 4 nats from the graph (bigram
statistics); after it, it is fully predictable by copying from P tokens back, which only
attention can do (an induction-style lookup). The loss falls from ln(vocab) towards
~(ln V + E[P] ln 4) / seqlen.

Pass/fail. bf16 rounds every activation to 8 significant bits; two correct attention kernels
that sum in different orders give different roundings, and training amplifies such
differences step by step, so the two curves cannot be bitwise equal. How far apart two
*correct* kernels drift is measured, not assumed: a third run with another SDPA backend
(the noise reference, default sdpa_efficient) against the reference (sdpa_flash). On the
H100 (default size, 300 steps) four SDPA backends (flash, efficient, cuDNN, math) ended
within 1e-4 nats of each other (smoothed, loss ~0.51), the largest per-step difference of
raw losses was 2.4e-3, and the step-0 gradients differed by ~2e-3 relative L2 (the bf16
unit roundoff is 2^-9 = 2e-3). cuflash is held to the same standard with margin:

* every loss is finite;
* final smoothed loss (mean of the last `window` steps): |cuflash - reference| <=
  max(5 x the noise run's difference, 1 % of the reference's loss, 0.005 nats);
* smoothed curves, at every step after the first window: |difference| <=
  max(5 x the noise run's largest difference, 2 % of the reference's loss + 0.005 nats);
* step 0 (same weights, same batch): loss within max(5 x noise, 1e-3) nats, gradient
  (all parameters, flattened) within max(3 x noise, 5e-3) relative L2 and cosine >= 0.999.

These catch a wrong mask, scale or gradient (errors of percents or more) while leaving
tens of times the measured bf16 spread; subtle per-element errors are the unit tests' job
(gradients vs the float64 reference).

    python -m cuflash.train_check [--steps 300] [--device cuda] [--out results]
                                  [--attn cuflash sdpa_flash sdpa_efficient] [--size small]

Writes <out>/<gpu>/train_check.{json,png} (<gpu> is "cpu" for --device cpu). On the CPU,
--size defaults to tiny and cuflash runs through its NumPy reference (slow: a few steps).
--device cuda without a usable GPU raises cuflash.NoGPUError (the script: one line, exit 2).
Exit status: 0 when the comparison passes, 1 when it does not.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _gpu

ATTN_IMPLS = ("cuflash", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 512
    n_heads: int = 8          # head dim = d_model / n_heads = 64
    n_layers: int = 4
    seqlen: int = 512


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    branching: int = 4        # successors per token in the walk graph
    min_period: int = 8
    max_period: int = 32


SIZES = {
    "small": (ModelConfig(), TrainConfig()),
    "tiny": (ModelConfig(vocab=32, d_model=64, n_heads=2, n_layers=2, seqlen=32),
             TrainConfig(steps=3, batch=2, warmup=1, min_period=4, max_period=8)),
}


# ---------------------------------------------------------------------------------------
# data

def walk_table(vocab: int, branching: int, seed: int) -> torch.Tensor:
    """(vocab, branching) successor table of the walk graph; fixed by the seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (vocab, branching), generator=g)


def make_batch(step: int, batch: int, seqlen: int, table: torch.Tensor, seed: int,
               min_period: int, max_period: int) -> torch.Tensor:
    """(batch, seqlen + 1) int64 tokens for this step, on the CPU, the same on every run."""
    vocab, branching = table.shape
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * step + 1)
    period = torch.randint(min_period, max_period + 1, (batch, 1), generator=g)
    choice = torch.randint(branching, (batch, max_period), generator=g)
    tok = torch.randint(vocab, (batch,), generator=g)
    walk = torch.empty(batch, max_period, dtype=torch.long)
    for t in range(max_period):
        walk[:, t] = tok
        tok = table[tok, choice[:, t]]
    pos = torch.arange(seqlen + 1).unsqueeze(0) % period  # (batch, seqlen + 1)
    return torch.gather(walk, 1, pos)


def loss_floor(mc: ModelConfig, tc: TrainConfig) -> float:
    """Loss of a model that knows the graph and copies perfectly (ignoring walk collisions)."""
    mean_p = (tc.min_period + tc.max_period) / 2
    return (math.log(mc.vocab) + (mean_p - 1) * math.log(tc.branching)) / mc.seqlen


# ---------------------------------------------------------------------------------------
# model

def attention(impl: str, q, k, v):
    """Causal attention on (b, s, h, d) tensors, returns (b, s, h, d)."""
    if impl == "cuflash":
        from .api import flash_attn_func

        return flash_attn_func(q, k, v, causal=True)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if impl == "sdpa":
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}[impl]
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return o.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, mc: ModelConfig, attn_impl: str):
        super().__init__()
        self.n_heads, self.attn_impl = mc.n_heads, attn_impl
        self.ln1, self.ln2 = nn.LayerNorm(mc.d_model), nn.LayerNorm(mc.d_model)
        self.qkv = nn.Linear(mc.d_model, 3 * mc.d_model, bias=False)
        self.proj = nn.Linear(mc.d_model, mc.d_model, bias=False)
        self.fc = nn.Linear(mc.d_model, 4 * mc.d_model, bias=False)
        self.fc_out = nn.Linear(4 * mc.d_model, mc.d_model, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = attention(self.attn_impl, q, k, v)
        x = x + self.proj(y.reshape(b, s, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, mc: ModelConfig, attn_impl: str):
        super().__init__()
        self.tok = nn.Embedding(mc.vocab, mc.d_model)
        self.pos = nn.Embedding(mc.seqlen, mc.d_model)
        self.blocks = nn.ModuleList(Block(mc, attn_impl) for _ in range(mc.n_layers))
        self.ln_f = nn.LayerNorm(mc.d_model)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * mc.n_layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.t()  # tied embeddings


def build_model(mc: ModelConfig, attn_impl: str, seed: int, device) -> GPT:
    """The same initial weights for every attn_impl: drawn on the CPU from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(mc, attn_impl)
    return model.to(device)


def _autocast(device):
    dev = torch.device(device).type
    return torch.autocast(dev, dtype=torch.bfloat16)


def _loss(model, tokens, device):
    with _autocast(device):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train(attn_impl: str, mc: ModelConfig, tc: TrainConfig, device="cuda", log=print) -> dict:
    """Train from the fixed seed; returns the per-step losses and timings."""
    model = build_model(mc, attn_impl, tc.seed, device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), foreach=True)

    def lr_at(step):
        if step < tc.warmup:
            return tc.lr * (step + 1) / tc.warmup
        frac = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
        return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    table = walk_table(mc.vocab, tc.branching, tc.seed)
    losses, grad_norms = [], []
    _sync(device)
    t0 = time.perf_counter()
    t_first = None
    for step in range(tc.steps):
        tokens = make_batch(step, tc.batch, mc.seqlen, table, tc.seed, tc.min_period,
                            tc.max_period).to(device)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        loss = _loss(model, tokens, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        losses.append(loss.detach())
        grad_norms.append(gn.detach())
        if step == 0:
            _sync(device)
            t_first = time.perf_counter()
        if log and (step % 50 == 0 or step == tc.steps - 1):
            log(f"  {attn_impl:>14} step {step:4d}  loss {loss.item():.4f}")
    _sync(device)
    t1 = time.perf_counter()
    steps_after_first = max(1, tc.steps - 1)
    return dict(loss=[float(x) for x in losses], grad_norm=[float(x) for x in grad_norms],
                wall_s=t1 - t0, first_step_s=(t_first or t1) - t0,
                ms_per_step=(t1 - (t_first or t0)) / steps_after_first * 1e3)


def init_grad_check(impls, mc: ModelConfig, tc: TrainConfig, device) -> dict:
    """Step 0, same weights, same batch: loss and flat-gradient cosine vs impls[1]."""
    table = walk_table(mc.vocab, tc.branching, tc.seed)
    tokens = make_batch(0, tc.batch, mc.seqlen, table, tc.seed, tc.min_period, tc.max_period).to(device)
    res = {}
    for impl in impls:
        model = build_model(mc, impl, tc.seed, device)
        loss = _loss(model, tokens, device)
        loss.backward()
        grad = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        res[impl] = (loss.item(), grad)
        del model
    ref_loss, ref_grad = res[impls[1]]
    out = {}
    for impl, (loss, grad) in res.items():
        cos = float(F.cosine_similarity(grad, ref_grad, dim=0))
        rel = float((grad - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30))
        out[impl] = dict(loss=loss, loss_diff=loss - ref_loss, grad_cos=cos, grad_rel_l2=rel)
    return out


# ---------------------------------------------------------------------------------------
# comparison (pure: tested on the CPU)

def smooth(xs, window: int):
    """Trailing moving average (the first points average what exists)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _curve_tol(ref_point: float, noise_curve: float) -> float:
    return max(5 * noise_curve, 0.02 * abs(ref_point) + 0.005)


def compare(runs: dict, cand: str, ref: str, noise: str | None, vocab: int, window: int,
            init: dict | None = None) -> dict:
    """Pass/fail of run `cand` against run `ref`, with tolerances scaled by run `noise`
    (see the module docstring). `init` is init_grad_check's result, or None."""
    s = {k: smooth(v["loss"], window) for k, v in runs.items()}
    n = len(s[ref])
    skip = min(window, max(0, n - 1))  # the first points of a trailing average are noisy

    def final(k):
        return s[k][-1]

    def curve_diffs(k):
        return [abs(a - b) for a, b in zip(s[k][skip:], s[ref][skip:])]

    noise_final = abs(final(noise) - final(ref)) if noise else 0.0
    noise_curve = max(curve_diffs(noise), default=0.0) if noise else 0.0
    diffs = curve_diffs(cand)
    res = dict(candidate=cand, reference=ref, noise_reference=noise, window=window,
               vocab=vocab, final_smoothed={k: final(k) for k in s},
               final_diff=abs(final(cand) - final(ref)),
               max_abs_diff_raw=max(abs(a - b) for a, b in zip(runs[cand]["loss"], runs[ref]["loss"])),
               max_abs_diff_smoothed=max(diffs, default=0.0),
               noise_final_diff=noise_final, noise_max_abs_diff_smoothed=noise_curve)
    res["tol_final"] = max(5 * noise_final, 0.01 * abs(final(ref)), 0.005)
    res["curve_worst_fraction_of_tol"] = max(
        (d / _curve_tol(r, noise_curve) for d, r in zip(diffs, s[ref][skip:])), default=0.0)
    res["finite"] = all(math.isfinite(x) for x in runs[cand]["loss"])
    res["final_ok"] = res["final_diff"] <= res["tol_final"]
    res["curve_ok"] = res["curve_worst_fraction_of_tol"] <= 1.0
    if noise and noise_final > 0:
        res["final_diff_over_noise"] = res["final_diff"] / noise_final
    checks = [res["finite"], res["final_ok"], res["curve_ok"]]
    if init:
        c = init[cand]
        nz = init.get(noise, {}) if noise else {}
        tol_loss = max(5 * abs(nz.get("loss_diff", 0.0)), 1e-3)
        tol_grad = max(3 * nz.get("grad_rel_l2", 0.0), 5e-3)
        res.update(init_tol_loss=tol_loss, init_tol_grad_rel_l2=tol_grad)
        res["init_ok"] = (abs(c["loss_diff"]) <= tol_loss and c["grad_rel_l2"] <= tol_grad
                          and c["grad_cos"] >= 0.999)
        checks.append(res["init_ok"])
    res["pass"] = all(checks)
    return res


def plot(result: dict, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs, cmp_ = result["runs"], result["comparison"]
    w, ref = cmp_["window"], cmp_["reference"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 7), sharex=True,
                                  gridspec_kw=dict(height_ratios=[2, 1]))
    for name, run in runs.items():
        line = ax.plot(run["loss"], lw=0.6, alpha=0.35)
        ax.plot(smooth(run["loss"], w), lw=1.6, color=line[0].get_color(),
                label=f"{name} (final {cmp_['final_smoothed'][name]:.4f}, {run['ms_per_step']:.1f} ms/step)")
    ax.axhline(result["loss_floor"], color="gray", ls=":", lw=1, label="task floor")
    ax.set_yscale("log")
    ax.set_ylabel("train loss (nats)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    sref = smooth(runs[ref]["loss"], w)
    for name, run in runs.items():
        if name != ref:
            ax2.plot([a - b for a, b in zip(smooth(run["loss"], w), sref)], label=f"{name} − {ref}")
    band = [_curve_tol(r, cmp_["noise_max_abs_diff_smoothed"]) for r in sref]
    steps = list(range(len(sref)))[w:]
    ax2.fill_between(steps, [-t for t in band[w:]], band[w:], color="gray", alpha=0.15,
                     label="curve tolerance")
    ax2.errorbar([len(sref) - 1], [0], yerr=[cmp_["tol_final"]], color="black", capsize=4,
                 label="final tolerance")
    ax2.set_yscale("symlog", linthresh=1e-3)  # linear within ±1e-3 nats: bf16 noise stays visible
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"Δ smoothed loss (window {w}), symlog")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    m = result["model"]
    fig.suptitle(f"GPT {m['n_layers']}L d{m['d_model']} {m['n_heads']}h s{m['seqlen']}, bf16 autocast, "
                 f"on {result['device_name']}: {'PASS' if cmp_['pass'] else 'FAIL'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------

def device_dir(device) -> str:
    if torch.device(device).type != "cuda":
        return "cpu"
    try:
        from .bench.common import gpu_dir_name

        return gpu_dir_name(torch.device(device).index or 0)
    except Exception:  # noqa: BLE001 - CuPy's view of the GPU is not essential here
        return torch.cuda.get_device_name(device).replace(" ", "_")


def run_check(attn=("cuflash", "sdpa_flash", "sdpa_efficient"), size="small", steps=None,
              device="cuda", out="results", window=None, log=print) -> dict:
    if torch.device(device).type == "cuda":
        _gpu.require("train_check on cuda (use --device cpu for the CPU reference path)")
    mc, tc = SIZES[size]
    if steps is not None:
        tc = TrainConfig(**{**asdict(tc), "steps": steps})
    attn = list(attn)
    if len(attn) < 2:
        raise ValueError("--attn needs at least a candidate and a reference")
    window = window or max(1, min(25, tc.steps // 10))
    dev_name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"
    log(f"train_check on {dev_name}: {mc}, {tc.steps} steps, batch {tc.batch}; attention {attn}")
    init = init_grad_check(attn, mc, tc, device)
    for k, v in init.items():
        log(f"  step-0 {k:>14}: loss {v['loss']:.5f} (Δ {v['loss_diff']:+.1e})  grad cos "
            f"{v['grad_cos']:.6f}  rel L2 {v['grad_rel_l2']:.2e}  (vs {attn[1]})")
    runs = {}
    for impl in attn:
        runs[impl] = train(impl, mc, tc, device, log)
    noise = attn[2] if len(attn) > 2 else None
    cmp_ = compare(runs, attn[0], attn[1], noise, mc.vocab, window, init)
    result = dict(device=str(device), device_name=dev_name, torch=torch.__version__,
                  model=asdict(mc), train=asdict(tc), loss_floor=loss_floor(mc, tc),
                  init_grad_check=init, runs=runs, comparison=cmp_)
    path = Path(out) / device_dir(device)
    path.mkdir(parents=True, exist_ok=True)
    (path / "train_check.json").write_text(json.dumps(result, indent=1))
    plotted = plot(result, path / "train_check.png")
    for impl, r in runs.items():
        log(f"  {impl:>14}: final smoothed loss {cmp_['final_smoothed'][impl]:.4f}, "
            f"{r['ms_per_step']:.1f} ms/step, first step {r['first_step_s']:.1f} s")
    log(f"  max |Δloss| {attn[0]} vs {attn[1]}: raw {cmp_['max_abs_diff_raw']:.4f}, smoothed "
        f"{cmp_['max_abs_diff_smoothed']:.4f}"
        + (f" ({noise} vs {attn[1]}: {cmp_['noise_max_abs_diff_smoothed']:.4f})" if noise else ""))
    log(f"  max |Δ smoothed| / curve tolerance: {cmp_['curve_worst_fraction_of_tol']:.2f}")
    log(f"  final smoothed loss: {attn[0]} {cmp_['final_smoothed'][attn[0]]:.4f} vs {attn[1]} "
        f"{cmp_['final_smoothed'][attn[1]]:.4f}: Δ {cmp_['final_diff']:.4f} "
        f"({100 * cmp_['final_diff'] / max(abs(cmp_['final_smoothed'][attn[1]]), 1e-12):.2f} %; "
        f"tol {cmp_['tol_final']:.4f}"
        + (f"; {noise} vs {attn[1]}: {cmp_['noise_final_diff']:.4f}" if noise else "") + ")")
    log(f"  task floor {result['loss_floor']:.4f} nats; ln V = {math.log(mc.vocab):.3f}")
    log(f"train_check: {'PASS' if cmp_['pass'] else 'FAIL'} "
        f"(finite {cmp_['finite']}, final {cmp_['final_ok']}, curve {cmp_['curve_ok']}"
        + (f", step-0 {cmp_['init_ok']}" if "init_ok" in cmp_ else "") + ")")
    log(f"wrote {path / 'train_check.json'}" + (", .png" if plotted else " (no matplotlib: no plot)"))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash.train_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="default 300 (small), 3 (tiny)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="results")
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="model size (default small on cuda, tiny on cpu)")
    ap.add_argument("--attn", nargs="+", choices=ATTN_IMPLS, default=None,
                    help="candidate, reference[, noise reference]; default "
                         "cuflash sdpa_flash sdpa_efficient on cuda, cuflash sdpa on cpu")
    ap.add_argument("--window", type=int, default=None, help="smoothing window (steps)")
    a = ap.parse_args(argv)
    cuda = torch.device(a.device).type == "cuda"
    size = a.size or ("small" if cuda else "tiny")
    attn = a.attn or (["cuflash", "sdpa_flash", "sdpa_efficient"] if cuda else ["cuflash", "sdpa"])
    res = run_check(attn, size, a.steps, a.device, a.out, a.window)
    return 0 if res["comparison"]["pass"] else 1


def _script() -> int:
    try:
        return main()
    except _gpu.NoGPUError as exc:
        print(f"cuflash.train_check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_script())
