"""BERT-base (12 layers, hidden 768, 12 heads, intermediate 3072, vocab 30522 padded to 30528)
from cuflash.models.bert in bf16 on the GPU, on a padded batch with random lengths: cuflash's
unpadded path (use_flash_attn=True: the padding removed once, every layer on the packed kept
tokens, varlen attention) against the same model on the same weights run padded, its attention
torch.nn.functional.scaled_dot_product_attention with the padding mask (use_flash_attn=False
with SDPA swapped into each MHA's inner attention; SDPA picks its backend for a masked call). A
sanity number, not a target (not a test).

    python tests/models_bert_timing.py [--batch 32] [--seqlen 512] [--iters 10] [--out timing.json]

Lengths uniform in [1, seqlen] (seed 0; the first row full, the second 1). Prints per peer the
median and min over --iters (CUDA events, 3 warm-up calls, the peers interleaved call by call) of
BertModel's forward (no_grad) and of a training step (forward, a loss on the kept tokens' hidden
states, backward), and the largest difference between cuflash's and SDPA's outputs at the kept
tokens. The cuflash peers are one model run three ways: cuflash_unpadded as it ships (the
encoder's forward varlen calls trust unpad_input's cu_seqlens: cuflash.api.trusted_cu_seqlens),
cuflash_checked with that trust removed (every layer's forward call reads cu_seqlens back: a host
sync per layer, the behaviour before), cuflash_nocheck with cuflash.api.CHECK_CU_SEQLENS off
(``CUFLASH_VARLEN_CHECK=0``: the backward's calls unchecked too). Also the host time of one
forward call (perf_counter around the call, no synchronize: how long Python takes to enqueue it)
and, at the model's shape, one layer's attention alone: cuflash's flash_attn_varlen_qkvpacked_func
on the packed tokens (check on and off) against SDPA on the padded batch with the mask (forward:
20 calls back to back per sample, the median per call over --iters samples).
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cuflash.api  # noqa: E402
import cuflash.models.bert as bert_module  # noqa: E402
from cuflash.models.bert import BertConfig, BertModel  # noqa: E402
from cuflash.padding import unpad_input  # noqa: E402


class SdpaSelfAttention(torch.nn.Module):
    """SelfAttention's forward (packed qkv (batch, seqlen, 3, heads, headdim), key_padding_mask
    True = keep) through SDPA with a boolean mask."""

    def __init__(self, inner):
        super().__init__()
        self.softmax_scale = inner.softmax_scale

    def forward(self, qkv, causal=None, key_padding_mask=None):
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.transpose(1, 2)


def bert_base(flash: bool):
    cfg = BertConfig(vocab_size=30522, pad_vocab_size_multiple=8, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, use_flash_attn=flash)
    torch.manual_seed(0)
    m = BertModel(cfg, add_pooling_layer=False).to(device="cuda", dtype=torch.bfloat16)
    if not flash:
        for layer in m.encoder.layers:
            layer.mixer.inner_attn = SdpaSelfAttention(layer.mixer.inner_attn)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    flash = bert_base(True)
    models = {"cuflash_unpadded": flash, "cuflash_checked": flash, "cuflash_nocheck": flash,
              "sdpa_padded": bert_base(False)}
    models["sdpa_padded"].load_state_dict(flash.state_dict())
    shipped_trust = bert_module.trusted_cu_seqlens

    def setup(name):
        """The peer's cu_seqlens checking: the global switch and the encoder's trust."""
        cuflash.api.CHECK_CU_SEQLENS = name != "cuflash_nocheck"
        bert_module.trusted_cu_seqlens = contextlib.nullcontext if name == "cuflash_checked" else shipped_trust
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, args.seqlen + 1, (args.batch,), generator=gen)
    lengths[0], lengths[1] = args.seqlen, 1
    mask = (torch.arange(args.seqlen)[None] < lengths[:, None]).cuda()
    ids = torch.randint(1, 30522, (args.batch, args.seqlen), generator=gen).cuda()
    types_ = torch.randint(0, 2, (args.batch, args.seqlen), generator=gen).cuda()
    kept = int(lengths.sum())

    def fwd(m):
        with torch.no_grad():
            return m(ids, token_type_ids=types_, attention_mask=mask).last_hidden_state

    def train_step(m):
        h = m(ids, token_type_ids=types_, attention_mask=mask).last_hidden_state
        loss = h[mask].float().square().mean()
        loss.backward()
        return loss

    outs = {}
    for name in ("cuflash_checked", "cuflash_unpadded", "sdpa_padded"):
        setup(name)
        outs[name] = fwd(models[name])[mask]
    setup("cuflash_unpadded")
    for _ in range(3):
        for name, m in models.items():
            setup(name)
            train_step(m)
            fwd(m)
    torch.cuda.synchronize()
    times = {(name, what): [] for name in models for what in ("forward", "train_step", "forward_host")}
    for _ in range(args.iters):
        for what, fn in (("forward", fwd), ("train_step", train_step)):
            for name, m in models.items():
                setup(name)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                t0 = time.perf_counter()
                fn(m)
                t1 = time.perf_counter()
                end.record()
                torch.cuda.synchronize()
                times[(name, what)].append(start.elapsed_time(end))
                if what == "forward":
                    times[(name, "forward_host")].append(1e3 * (t1 - t0))
    setup("cuflash_unpadded")
    diff = (outs["cuflash_unpadded"].float() - outs["sdpa_padded"].float()).abs().max().item()
    result_attn = attention_alone(flash, mask, args.iters)
    result = {"device": torch.cuda.get_device_name(), "batch": args.batch, "seqlen": args.seqlen,
              "kept_tokens": kept, "padded_tokens": args.batch * args.seqlen, "iters": args.iters,
              "max_abs_diff_kept": diff, "times_ms": {}}
    print(f"{result['device']}: BERT-base bf16, batch {args.batch} x {args.seqlen}, {kept} kept tokens of "
          f"{args.batch * args.seqlen} ({100 * kept / (args.batch * args.seqlen):.1f} %)")
    for (name, what), ts in times.items():
        med, low = statistics.median(ts), min(ts)
        result["times_ms"][f"{name}/{what}"] = {"median": med, "min": low, "all": ts}
        print(f"{name:18s} {what:11s} median {med:8.3f} ms  min {low:8.3f} ms")
    for what in ("forward", "train_step"):
        b = result["times_ms"][f"sdpa_padded/{what}"]["median"]
        for name in ("cuflash_unpadded", "cuflash_checked", "cuflash_nocheck"):
            a = result["times_ms"][f"{name}/{what}"]["median"]
            print(f"{what}: sdpa_padded / {name} = {b / a:.2f}x")
    result["attention_alone_ms"] = result_attn
    for name, ms in result_attn.items():
        print(f"one layer's attention alone, forward: {name:28s} median {ms:8.4f} ms")
    same = bool(torch.equal(outs["cuflash_unpadded"], outs["cuflash_checked"]))
    result["trusted_equals_checked"] = same
    print(f"cuflash_unpadded's output bitwise equal to cuflash_checked's: {same}")
    print(f"hidden states at kept tokens: max |cuflash - sdpa| {diff:.3e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def attention_alone(model, mask, iters):
    """One layer's attention forward at the model's shape (bf16, 12 heads x 64): cuflash's varlen
    call on the packed tokens, with and without the cu_seqlens check, and SDPA on the padded batch
    with the mask. Per call: 20 calls between two CUDA events, median over iters."""
    from cuflash import flash_attn_varlen_qkvpacked_func

    batch, seqlen = mask.shape
    qkv = torch.randn(batch, seqlen, 3, 12, 64, device="cuda", dtype=torch.bfloat16)
    packed, _, cu, longest, _ = unpad_input(qkv, mask)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
    bias = mask[:, None, None, :]
    calls = {
        "cuflash_varlen": lambda: flash_attn_varlen_qkvpacked_func(packed, cu, longest),
        "cuflash_varlen_nocheck": lambda: flash_attn_varlen_qkvpacked_func(packed, cu, longest),
        "sdpa_padded_masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
    }
    out = {}
    for name, fn in calls.items():
        cuflash.api.CHECK_CU_SEQLENS = name != "cuflash_varlen_nocheck"
        with torch.no_grad():
            for _ in range(3):
                fn()
            ts = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(20):
                    fn()
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end) / 20)
        out[name] = statistics.median(ts)
    cuflash.api.CHECK_CU_SEQLENS = True
    return out


if __name__ == "__main__":
    main()
