"""ViT-B/16 (cuflash.models.vit.vit_base_patch16_224: 86.6 M parameters, 197 tokens, 12 heads of
64) in bf16 on the GPU: a forward (eval, no grad: the last layer on the class token only) and a
training step (forward, cross-entropy over 1000 classes, backward) at --batch 224 x 224 images.
Peers in one process on the same weights, interleaved step by step:
* cuflash: use_flash_attn=True and fused_dropout_add_ln=True (cuflash's attention kernels and its
  fused dropout + add + LayerNorm kernels, as flash-attn's ViT is meant to run);
* cuflash_ln_torch: cuflash's attention, torch's LayerNorm;
* sdpa: the same model with torch.nn.functional.scaled_dot_product_attention in the inner
  attention's place (self- and the last layer's cross-attention), torch's LayerNorm.
A sanity number, not a target (not a test).

    python tests/models_vit_timing.py [--batch 64] [--iters 20] [--global-pool token|map] [--out timing.json]

--global-pool map: the SigLIP-B/16 layout instead (no class token, 196 tokens, timm's MAP head: a
latent query attending over every token, on cuflash's kernels or, for the sdpa peer, SDPA).

Prints one line per (peer, what): median and min over --iters (CUDA events, after 3 warm-up
steps), images/s, the peers' largest logit difference, and the attention alone at the model's
shape (non-causal packed qkv, cuflash's flash_attn_qkvpacked_func against SDPA).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cuflash.models.vit import vit_base_patch16_224  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_gpt_timing as gpt_timing  # noqa: E402 - its SDPA wrapper and attention-only timing
from models_gpt_timing import SdpaSelfAttention  # noqa: E402


class SdpaCrossAttention(SdpaSelfAttention):
    """FlashCrossAttention's forward (q (batch, seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2,
    heads, head_dim)) through SDPA (non-causal here)."""

    def forward(self, q, kv, causal=None, **kwargs):
        k, v = kv.unbind(dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=self.causal if causal is None else causal,
                                             scale=self.softmax_scale)
        return out.transpose(1, 2)


def build(peer: str, global_pool: str = "token"):
    torch.manual_seed(0)
    layout = dict(global_pool="map", class_token=False) if global_pool == "map" else {}
    m = vit_base_patch16_224(use_flash_attn=True, fused_dropout_add_ln=peer == "cuflash", device="cuda",
                             dtype=torch.bfloat16, **layout)
    if peer == "sdpa":
        for block in m.blocks:
            block.mixer.inner_attn = SdpaSelfAttention(block.mixer.inner_attn)
            block.mixer.inner_cross_attn = SdpaCrossAttention(block.mixer.inner_cross_attn)
        if m.attn_pool is not None:
            m.attn_pool.inner_attn = SdpaCrossAttention(m.attn_pool.inner_attn)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--global-pool", default="token", choices=["token", "map"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    peers = ("cuflash", "cuflash_ln_torch", "sdpa")
    models = {p: build(p, args.global_pool) for p in peers}
    for p in peers[1:]:
        models[p].load_state_dict(models["cuflash"].state_dict())
    n_params = sum(p.numel() for p in models["cuflash"].parameters())
    img = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (args.batch,), device="cuda")

    def train_step(m):
        m.train()
        loss = F.cross_entropy(m(img).float(), labels)
        loss.backward()
        return loss

    def fwd(m):
        m.eval()
        with torch.no_grad():
            return m(img)

    losses, logits = {}, {}
    for name, m in models.items():          # warm-up (first calls compile cuflash's kernels)
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            losses[name] = train_step(m).item()
            logits[name] = fwd(m).float()
    torch.cuda.synchronize()
    diff = {name: (logits[name] - logits["sdpa"]).abs().max().item() for name in peers}
    times = {(name, what): [] for name in models for what in ("train step", "forward")}
    for _ in range(args.iters):
        for name, m in models.items():
            for what, fn in (("train step", train_step), ("forward", fwd)):
                m.zero_grad(set_to_none=True)
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(m)
                stop.record()
                torch.cuda.synchronize()
                times[(name, what)].append(start.elapsed_time(stop))
    rows = []
    for (name, what), ts in times.items():
        med = statistics.median(ts)
        row = dict(peer=name, what=what, batch=args.batch, global_pool=args.global_pool,
                   median_ms=med, min_ms=min(ts), iters=len(ts),
                   images_per_s=args.batch / (med / 1e3), params=n_params, loss=losses[name],
                   max_abs_logit_diff_vs_sdpa=diff[name], device=torch.cuda.get_device_name(),
                   torch=torch.__version__)
        rows.append(row)
        print(f"{name:17s} {what:10s} median {med:8.2f} ms  min {min(ts):8.2f} ms  {row['images_per_s']:8.0f} img/s")
    print(f"params {n_params / 1e6:.2f} M; losses " + ", ".join(f"{n} {losses[n]:.5f}" for n in peers)
          + "; max |logits - sdpa's| " + ", ".join(f"{n} {diff[n]:.3e}" for n in peers[:2])
          + f"; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    rows += attention_only(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def attention_only(args) -> list:
    """The attention alone at ViT-B/16's shape (batch, 197 tokens, 12 heads, head dim 64, non-causal):
    models_gpt_timing.attention_only's peers and timing; x 12 layers is roughly the model's share (the
    forward's last layer is a 1-query cross-attention)."""
    return gpt_timing.attention_only(args, seqlen=196 if args.global_pool == "map" else 197, causal=False)


if __name__ == "__main__":
    main()
