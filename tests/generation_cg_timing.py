"""Greedy generation speed of cuflash.models.gpt.GPTLMHeadModel in bf16 (random weights), decode
with and without CUDA graphs (cg=True / cg=False), against the same model with its attention
on torch.nn.functional.scaled_dot_product_attention over a plain torch KV cache ((batch,
kv heads, seqlen, head dim) k and v per layer: eager, the keys up to the host's offset; in the
graph, written at the per-row lengths and masked to them). Not a test.

    python tests/generation_cg_timing.py [--cells gpt2:1,llama1b:1,gpt2:8,llama1b:8] [--prompt 128]
        [--new 256] [--reps 2] [--peers cuflash,cuflash_lt,cuflash_cg,sdpa,sdpa_cg] [--out timing.json]

Models: gpt2 (GPT-2 small, 124M: 12 layers, 768 wide, 12 heads, vocab 50257 padded to 50304,
learned positions) and llama1b (TinyLlama-1.1B's shape: 22 layers, 2048 wide, 32 heads, 4 kv
heads, SwiGLU 5632, RMSNorm, full interleaved rotary, vocab 32000). One process; per (model,
batch) each peer runs once to warm up (kernels compiled, graphs captured), then --reps times,
the peers interleaved. Each generate is timed with CUDA events around the whole call (prompt
included); the prompt's forward alone is timed too, so decode ms/step = (total - prompt) /
(new - 1). The host time of one eager decode step (the model's forward enqueueing its kernels,
perf_counter) and of one graph step (cache.run) is the median over 16 steps run back to back
(no sync between them; their wall time per step from CUDA events). Writes
every cell to --out as it is measured. Peers: cuflash (decode(cg=False), flash-attn's int
seqlen_offset), cuflash_lt (cg=False with EAGER_LENGTHS_TENSOR: the lengths as a tensor),
cuflash_cg (cg=True), sdpa, sdpa_cg (the SDPA attention, eager and captured).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402
from cuflash.utils import generation  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

CONFIGS = {
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, pad_vocab_size_multiple=8),
    "llama1b": dict(vocab_size=32000, n_positions=0, n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_inner=5632,
                    activation_function="swiglu", rms_norm=True, rotary_emb_fraction=1.0, rotary_emb_interleaved=True,
                    qkv_proj_bias=False, out_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False,
                    tie_word_embeddings=False, layer_norm_epsilon=1e-5),
}


def build(name, n_layer=None):
    cfg = dict(CONFIGS[name], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_flash_attn=True)
    if n_layer is not None:
        cfg["n_layer"] = n_layer
    torch.manual_seed(0)
    return GPTLMHeadModel(GPT2Config(**cfg), device="cuda", dtype=torch.bfloat16).eval()


# the eager SDPA calls (a new key length every step): flash, then memory-efficient, then math;
# not cuDNN's, which builds a plan per new shape (13.6 s over a first 256-token run in round 2)
EAGER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# ---------------------------------------------------------------------------------------
# the SDPA peer: the mixers' cache + attention step replaced (instance attributes)

def _sdpa_attend(mixer, q, kv, params):
    """q (b, n, heads, d) and kv (b, n, 2, kv heads, d), rotated: kv into this layer's torch cache,
    then SDPA of q over it. The prompt (seqlen_offset 0): causal over its own keys. Eager steps
    (no lengths_per_sample): the cache up to seqlen_offset + n (EAGER_BACKENDS). Graph steps:
    written at each row's length, all max_seqlen keys masked to the row's length (+ the causal
    new ones), SDPA's own backend choice (one shape, planned once)."""
    b, n = q.shape[:2]
    key = ("sdpa", mixer.layer_idx)
    store = params.key_value_memory_dict.get(key)
    if store is None:
        shape = (params.max_batch_size, kv.shape[3], params.max_seqlen, kv.shape[4])
        # zeros: the graph's masked keys are read too (garbage NaNs would leak through the mask)
        store = params.key_value_memory_dict[key] = (kv.new_zeros(shape), kv.new_zeros(shape))
    k_cache, v_cache = store
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)        # (b, kv heads, n, d)
    qt = q.transpose(1, 2)
    gqa = dict(enable_gqa=True) if q.shape[2] != kv.shape[3] else {}
    scale = mixer.inner_cross_attn.softmax_scale
    if params.seqlen_offset == 0:
        k_cache[:b, :, :n], v_cache[:b, :, :n] = k, v
        with sdpa_kernel(EAGER_BACKENDS):
            out = F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, **gqa)
    elif params.lengths_per_sample is None:
        if n != 1:
            raise ValueError("the SDPA peer decodes one token per step")
        s0 = params.seqlen_offset
        k_cache[:b, :, s0:s0 + 1], v_cache[:b, :, s0:s0 + 1] = k, v
        with sdpa_kernel(EAGER_BACKENDS):
            out = F.scaled_dot_product_attention(qt, k_cache[:b, :, :s0 + 1], v_cache[:b, :, :s0 + 1], scale=scale,
                                                 **gqa)
    else:
        lengths = params.lengths_per_sample[:b].long()
        pos = lengths[:, None] + torch.arange(n, device=q.device)                  # (b, n)
        rows = torch.arange(b, device=q.device)[:, None]
        k_cache[rows, :, pos] = kv[:, :, 0]                                         # (b, n, kv heads, d)
        v_cache[rows, :, pos] = kv[:, :, 1]
        keys = torch.arange(k_cache.shape[2], device=q.device)
        mask = keys[None, None, :] <= pos[:, :, None]                              # (b, n, max_seqlen)
        out = F.scaled_dot_product_attention(qt, k_cache[:b], v_cache[:b], attn_mask=mask[:, None], scale=scale,
                                             **gqa)
    return out.transpose(1, 2)


def set_sdpa(model, on: bool):
    for layer in model.transformer.layers:
        mixer = layer.mixer
        for attr in ("_update_kvcache_attention", "_apply_rotary_update_kvcache_attention"):
            mixer.__dict__.pop(attr, None)
        if not on:
            continue

        def attend(q, kv, params, mixer=mixer):
            return _sdpa_attend(mixer, q, kv, params)

        def rotary_attend(q, kv, params, mixer=mixer):
            offsets = (params.lengths_per_sample[:q.shape[0]] if params.lengths_per_sample is not None
                       else params.seqlen_offset)
            q, kv = mixer.rotary_emb(q, kv, seqlen_offset=offsets, max_seqlen=params.max_seqlen)
            return _sdpa_attend(mixer, q, kv, params)

        mixer._update_kvcache_attention = attend
        mixer._apply_rotary_update_kvcache_attention = rotary_attend


# ---------------------------------------------------------------------------------------

def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


@torch.inference_mode()
def host_step_times(model, prompt, max_length, cg, lengths_tensor, steps=16):
    """(host µs per decode step (median of the calls' perf_counter times), wall µs per step (CUDA
    events over the steps, no sync between them)) after the prompt; eager steps with
    lengths_tensor fill inference_params.lengths_per_sample first (as decode does)."""
    batch = prompt.shape[0]
    if cg:
        cache = model._decoding_cache
        params = cache.inference_params
        params.reset(max_length, batch)
    else:
        lengths = torch.zeros(batch, dtype=torch.int32, device="cuda") if lengths_tensor else None
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch, lengths_per_sample=lengths)
    logits = model(prompt, inference_params=params, num_last_tokens=1).logits[:, -1]
    params.seqlen_offset = prompt.shape[1]
    tok = logits.argmax(-1)[:, None]
    positions = [torch.full((batch, 1), prompt.shape[1] + i, dtype=torch.long, device="cuda") for i in range(steps)]
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for pos in positions:
        t0 = time.perf_counter()
        if cg:
            out = cache.run(tok, pos, params.seqlen_offset)
        else:
            if lengths_tensor:
                params.lengths_per_sample.fill_(params.seqlen_offset)
            out = model(tok, position_ids=pos, inference_params=params, num_last_tokens=1).logits
        host.append((time.perf_counter() - t0) * 1e6)
        tok = out[:, -1].argmax(-1)[:, None]
        params.seqlen_offset += 1
    end.record()
    end.synchronize()
    return statistics.median(host), start.elapsed_time(end) * 1e3 / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="gpt2:1,llama1b:1,gpt2:8,llama1b:8", help="model:batch, in order")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--peers", default="", help="a subset, in order (cuflash,cuflash_lt,cuflash_cg,sdpa,sdpa_cg)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "prompt": args.prompt,
               "new_tokens": args.new, "reps": args.reps, "cells": []}
    # peer: (SDPA attention, cg, decode's EAGER_LENGTHS_TENSOR)
    peers = {"cuflash": (False, False, False), "cuflash_lt": (False, False, True), "cuflash_cg": (False, True, False),
             "sdpa": (True, False, False), "sdpa_cg": (True, True, False)}
    if args.peers:
        peers = {p: peers[p] for p in args.peers.split(",")}
    max_length = args.prompt + args.new
    models = {}
    for name, batch in (c.split(":") for c in args.cells.split(",")):
        batch = int(batch)
        if name not in models:
            models[name] = build(name)
        model = models[name]
        n_params = sum(p.numel() for p in model.parameters())
        prompt = torch.randint(0, CONFIGS[name]["vocab_size"], (batch, args.prompt), device="cuda")
        caches, times, tokens = {}, {p: [] for p in peers}, {}

        def run(peer):
            sdpa, cg, lt = peers[peer]
            set_sdpa(model, sdpa)
            generation.EAGER_LENGTHS_TENSOR = lt
            model._decoding_cache = caches.get(peer)
            ms, seq = timed(lambda: model.generate(prompt, max_length, cg=cg))
            caches[peer] = getattr(model, "_decoding_cache", None)
            print(f"  {name} b{batch} {peer}: {ms:.1f} ms", flush=True)
            return ms, seq

        warm = {}
        for peer in peers:
            warm[peer], tokens[peer] = run(peer)
        for _ in range(args.reps):
            for peer in peers:
                ms, seq = run(peer)
                times[peer].append(ms)
                if not torch.equal(seq, tokens[peer]):
                    print(f"  {name} b{batch} {peer}: tokens changed between runs", flush=True)
        cell = {"model": name, "params_M": round(n_params / 1e6, 1), "batch": batch, "peers": {}}
        for sdpa in (False, True):                       # the prompt's forward alone
            set_sdpa(model, sdpa)
            with torch.inference_mode():
                pf = [timed(lambda: model(prompt, inference_params=InferenceParams(max_length, batch),
                                          num_last_tokens=1))[0] for _ in range(3)]
            cell["prompt_ms_" + ("sdpa" if sdpa else "cuflash")] = statistics.median(pf)
        for peer, (sdpa, cg, lt) in peers.items():
            set_sdpa(model, sdpa)
            model._decoding_cache = caches.get(peer)
            host_us, wall_us = host_step_times(model, prompt, max_length, cg, lt)
            total = statistics.median(times[peer])
            prompt_ms = cell["prompt_ms_" + ("sdpa" if sdpa else "cuflash")]
            cell["peers"][peer] = {
                "total_ms": round(total, 3), "all_ms": [round(t, 3) for t in times[peer]],
                "warmup_ms": round(warm[peer], 1), "ms_per_token": round(total / args.new, 4),
                "tokens_per_s": round(batch * args.new / total * 1e3, 1),
                "decode_ms_per_step": round((total - prompt_ms) / (args.new - 1), 4),
                "host_us_per_step": round(host_us, 1), "wall_us_per_step": round(wall_us, 1)}
        first = tokens[next(iter(peers))]
        cell["tokens_equal_rows_vs_" + next(iter(peers))] = {
            p: int((t == first).all(dim=1).sum()) for p, t in tokens.items()}
        set_sdpa(model, False)
        generation.EAGER_LENGTHS_TENSOR = False
        model._decoding_cache = None
        caches.clear()
        results["cells"].append(cell)
        for peer, r in cell["peers"].items():
            print(f"{name} b{batch} {peer:11s} total {r['total_ms']:8.1f} ms  {r['ms_per_token']:.3f} ms/token  "
                  f"{r['tokens_per_s']:8.1f} tok/s  decode {r['decode_ms_per_step']:.3f} ms/step  host "
                  f"{r['host_us_per_step']:.0f} us/step  wall {r['wall_us_per_step']:.0f} us/step", flush=True)
        print(f"{name} b{batch} prompt {cell['prompt_ms_cuflash']:.2f} ms (sdpa {cell['prompt_ms_sdpa']:.2f}); "
              f"rows with tokens equal to the first peer's {cell['tokens_equal_rows_vs_' + next(iter(peers))]}",
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
