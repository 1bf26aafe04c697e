"""Why the MAP head's latent gradient in bf16 can be several times the plain bf16 peer's error (a
diagnostic, not a test; session 31 mdl5 round 1: ViT "map" without class token, latent grad 3.8x,
q.weight grad 4.3x the plain peer's error, 7.8e-7 / 3.3e-7 absolute). Since round 2 the pool
centers its keys with use_flash_attn (AttentionPoolLatent.center_keys); part 2 switches it off for
the "cuflash" peer and on for "cuflash_centered_k".

Hypothesis: FlashAttention-2's backward takes D = rowsum(dO * O) from the stored bf16 O, so sum_j
dS_j = dO . (O_fp32 - O_bf16) is not 0 and dq = scale * sum_j dS_j k_j gets an error term
scale * (sum_j dS_j) * mean_j(k_j): large when the keys share a large mean (LayerNorm'd tokens
through kv's bias) while the true dq is small (a near-uniform attention: the latent at its init).
The plain bf16 attention's softmax backward uses its own rounded P consistently (sum_j dS_j ~ 0).
Softmax is invariant to subtracting the mean key from every key (q . mean(k) is one constant per
row), so centering the keys removes the term without changing the forward's value.

Part 1, one query over N keys (batch 64, 4 heads of 64), dq's error against float64 for: cuflash's
kernels; the plain bf16 attention; an emulation in float64 of FA2's dq from bf16 inputs with D from
the bf16-rounded O (and from the exact O); cuflash on the centered keys. Keys with a common mean
of 0 and of 2 (per channel, N(0, 2²)), queries scaled 0.05 (near-uniform) and 1.

Part 2, the GPU test's ViT "map" (no class token, 48 x 40 images, embed 256, 4 heads, depth 3)
against float64: each gradient's error for cuflash, cuflash with the pool's keys centered, and the
plain bf16 model, also relative to the gradient's largest element; three image draws.

    python tests/attention_pool_dq_diag.py [--out diag.json]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuflash.api import flash_attn_kvpacked_func  # noqa: E402


def plain_attn(q, k, v, scale):
    """(batch, seqlen, heads, d) layouts, scores and softmax in the input dtype (MHA's torch path)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k * scale)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1, dtype=v.dtype), v)


def center(k):
    """k minus its mean over the keys (fp32), rounded back to k's dtype."""
    kf = k.float()
    return (kf - kf.mean(dim=1, keepdim=True)).to(k.dtype)


def fa2_dq_emulated(q, k, v, do, scale, round_o):
    """dq as FA2's backward forms it, in float64 from the bf16 inputs: P exact, dP = dO v, D from O
    rounded to bf16 (round_o) or exact, dS = P (dP - D), dq = scale dS k."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = torch.softmax(s, -1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if round_o:
        o = o.bfloat16().double()
    d = (do * o).sum(-1).transpose(1, 2)[..., None]            # (b, h, q, 1)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v)
    ds = p * (dp - d)
    return torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale


def part1(rows):
    torch.manual_seed(0)
    b, h, d = 64, 4, 64
    scale = d ** -0.5
    for n in (30, 197):
        for mean in (0.0, 2.0):
            for qs in (0.05, 1.0):
                q = (torch.randn(b, 1, h, d) * qs).cuda().bfloat16()
                mu = torch.randn(1, 1, h, d) * mean
                k = (torch.randn(b, n, h, d) + mu).cuda().bfloat16()
                v = torch.randn(b, n, h, d).cuda().bfloat16()
                do = torch.randn(b, 1, h, d).cuda().bfloat16()
                q64 = q.double().requires_grad_(True)
                plain_attn(q64, k.double(), v.double(), scale).backward(do.double())
                ref = q64.grad
                errs = {}
                for name, kk in (("cuflash", k), ("cuflash_centered_k", center(k))):
                    qq = q.clone().requires_grad_(True)
                    flash_attn_kvpacked_func(qq, torch.stack([kk, v], dim=2)).backward(do)
                    errs[name] = (qq.grad.double() - ref).abs().max().item()
                qq = q.clone().requires_grad_(True)
                plain_attn(qq, k, v, scale).backward(do)
                errs["plain_bf16"] = (qq.grad.double() - ref).abs().max().item()
                for name, r in (("emul_D_from_bf16_O", True), ("emul_D_exact", False)):
                    errs[name] = (fa2_dq_emulated(q, k, v, do, scale, r) - ref).abs().max().item()
                mx = ref.abs().max().item()
                row = dict(part=1, seqlen_k=n, key_mean_std=mean, q_scale=qs, max_abs_dq=mx, **errs)
                rows.append(row)
                print(f"N {n:4d} key mean {mean:.0f} q x{qs:<4} max|dq| {mx:.3e}  " + "  ".join(
                    f"{k_}: {e:.2e} ({e / errs['plain_bf16']:.2f}x)" for k_, e in errs.items()))


def part2(rows):
    import test_models_vit_baichuan_btlm_gpu as t

    kw = dict(global_pool="map", class_token=False)
    ref = t.vit(False, torch.float64, device="cpu", **kw)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("gamma"):
                p.add_(torch.randn_like(p) * 0.2)
    state = ref.state_dict()
    models = {"ref": ref, "cuflash": t.vit(True, torch.bfloat16, state=state, **kw),
              "cuflash_centered_k": t.vit(True, torch.bfloat16, state=state, **kw),
              "plain_bf16": t.vit(False, torch.bfloat16, state=state, **kw)}
    models["cuflash"].attn_pool.center_keys = False
    models["cuflash_centered_k"].attn_pool.center_keys = True
    names = ["attn_pool.latent", "attn_pool.q.weight", "attn_pool.kv.weight", "attn_pool.mlp.fc1.weight",
             "blocks.2.mixer.Wqkv.weight", "patch_embed.proj.weight", "pos_embed"]
    for draw in range(3):
        torch.manual_seed(100 + draw)
        img = torch.randn(6, 3, 48, 40)
        labels = torch.randint(0, 10, (6,))
        out = {}
        for key, m in models.items():
            dev, dt = m.pos_embed.device, m.pos_embed.dtype
            logits = m.train()(img.to(dev, dt))
            loss = F.cross_entropy(logits.float(), labels.to(dev))
            params = dict(m.named_parameters())
            out[key] = (logits.detach().double().cpu(), [g.double().cpu() for g in
                                                        torch.autograd.grad(loss, [params[n] for n in names])])
        for i, name in enumerate(["logits"] + names):
            get = (lambda k: out[k][0]) if i == 0 else (lambda k, i=i: out[k][1][i - 1])
            r = get("ref")
            errs = {k: (get(k) - r).abs().max().item() for k in ("cuflash", "cuflash_centered_k", "plain_bf16")}
            mx = r.abs().max().item()
            rows.append(dict(part=2, draw=draw, tensor=name, max_abs_ref=mx, **errs))
            print(f"draw {draw} {name:28s} max|ref| {mx:.3e}  " + "  ".join(
                f"{k}: {e:.2e} ({e / max(errs['plain_bf16'], 1e-30):.2f}x, rel {e / max(mx, 1e-30):.1e})"
                for k, e in errs.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    part1(rows)
    part2(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
