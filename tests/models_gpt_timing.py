"""GPT-2 small (124M: 12 layers, n_embd 768, 12 heads, vocab 50257 padded to 50304, learned
positions) from cuflash.models.gpt in bf16 on the GPU: one training step (forward, cross-entropy
loss, backward) and a forward alone at batch x seqlen tokens, with the attention on cuflash's
kernels (use_flash_attn=True) and, in the same process on the same weights, with
torch.nn.functional.scaled_dot_product_attention in the same place (the MHA's inner attention
swapped). A sanity number, not a target (not a test).

    python tests/models_gpt_timing.py [--batch 8] [--seqlen 1024] [--iters 10] [--out timing.json]

Prints one line per (peer, what) with the median and min over --iters (CUDA events, after 3
warm-up steps, the peers interleaved step by step), the two peers' loss difference, and the
attention alone at the model's shape (cuflash's flash_attn_qkvpacked_func against SDPA).
"""
import argparse
import json
import os
import statistics
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402


class SdpaSelfAttention(torch.nn.Module):
    """FlashSelfAttention's forward on packed qkv (batch, seqlen, 3, heads, headdim) through
    torch's scaled_dot_product_attention (its own backend choice: flash / memory-efficient)."""

    def __init__(self, inner):
        super().__init__()
        self.causal, self.softmax_scale = inner.causal, inner.softmax_scale

    def forward(self, qkv, causal=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal if causal is None else causal,
                                             scale=self.softmax_scale)
        return out.transpose(1, 2)


def gpt2_small(use_sdpa: bool):
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     pad_vocab_size_multiple=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_flash_attn=True)
    torch.manual_seed(0)
    m = GPTLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16)
    if use_sdpa:
        for layer in m.transformer.layers:
            layer.mixer.inner_attn = SdpaSelfAttention(layer.mixer.inner_attn)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    models = {"cuflash": gpt2_small(False), "sdpa": gpt2_small(True)}
    models["sdpa"].load_state_dict(models["cuflash"].state_dict())
    n_params = sum(p.numel() for p in models["cuflash"].parameters())
    ids = torch.randint(0, 50257, (args.batch, args.seqlen), device="cuda")
    labels = torch.randint(0, 50257, (args.batch, args.seqlen), device="cuda")

    def train_step(m):
        logits = m(ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        return loss

    def fwd(m):
        with torch.no_grad():
            return m(ids).logits

    losses = {}
    for name, m in models.items():          # warm-up (first calls compile cuflash's kernels)
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            losses[name] = train_step(m).item()
            fwd(m)
    torch.cuda.synchronize()
    times = {(name, what): [] for name in models for what in ("fwd+bwd", "fwd")}
    for _ in range(args.iters):
        for name, m in models.items():
            for what, fn in (("fwd+bwd", train_step), ("fwd", fwd)):
                m.zero_grad(set_to_none=True)
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(m)
                stop.record()
                torch.cuda.synchronize()
                times[(name, what)].append(start.elapsed_time(stop))
    rows = []
    tokens = args.batch * args.seqlen
    for (name, what), ts in times.items():
        row = dict(peer=name, what=what, batch=args.batch, seqlen=args.seqlen, median_ms=statistics.median(ts),
                   min_ms=min(ts), iters=len(ts), tokens_per_s=tokens / (statistics.median(ts) / 1e3),
                   params=n_params, loss=losses[name], device=torch.cuda.get_device_name(),
                   torch=torch.__version__)
        rows.append(row)
        print(f"{name:8s} {what:8s} median {row['median_ms']:8.2f} ms  min {row['min_ms']:8.2f} ms  "
              f"{row['tokens_per_s'] / 1e3:8.1f} ktok/s")
    print(f"params {n_params / 1e6:.1f} M; loss cuflash {losses['cuflash']:.5f} sdpa {losses['sdpa']:.5f} "
          f"(|diff| {abs(losses['cuflash'] - losses['sdpa']):.2e}); peak memory "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    rows += attention_only(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def attention_only(args, seqlen=None, causal=True) -> list:
    """The attention alone at the model's shape (batch, seqlen (args.seqlen unless given), 12 heads,
    head dim 64, causal or not, packed qkv as MHA passes it): cuflash's flash_attn_qkvpacked_func
    against SDPA, forward + backward and forward, interleaved, median over --iters; x 12 layers is
    the model's share (models_vit_timing.py: 197 tokens, non-causal)."""
    from cuflash.api import flash_attn_qkvpacked_func

    seqlen = args.seqlen if seqlen is None else seqlen
    qkv = torch.randn(args.batch, seqlen, 3, 12, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(args.batch, seqlen, 12, 64, device="cuda", dtype=torch.bfloat16)
    sdpa = SdpaSelfAttention(types.SimpleNamespace(causal=causal, softmax_scale=None))
    peers = {"cuflash": lambda: flash_attn_qkvpacked_func(qkv, causal=causal), "sdpa": lambda: sdpa(qkv)}
    out = {name: fn() for name, fn in peers.items()}
    err = (out["cuflash"].float() - out["sdpa"].float()).abs().max().item()
    times = {(name, what): [] for name in peers for what in ("fwd+bwd", "fwd")}
    for it in range(args.iters + 3):
        for name, fn in peers.items():
            for what in ("fwd+bwd", "fwd"):
                qkv.grad = None
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if what == "fwd":
                    with torch.no_grad():
                        fn()
                else:
                    fn().backward(dout)
                stop.record()
                torch.cuda.synchronize()
                if it >= 3:
                    times[(name, what)].append(start.elapsed_time(stop))
    rows = []
    for (name, what), ts in times.items():
        rows.append(dict(peer=name, what=f"attention {what}", batch=args.batch, seqlen=seqlen,
                         median_ms=statistics.median(ts), min_ms=min(ts), iters=len(ts), max_abs_diff_vs_sdpa=err))
        print(f"attention {name:8s} {what:8s} median {statistics.median(ts):7.3f} ms  min {min(ts):7.3f} ms "
              f"(x 12 layers {12 * statistics.median(ts):6.2f} ms)")
    print(f"attention output max |cuflash - sdpa| {err:.3e}")
    return rows


if __name__ == "__main__":
    main()
