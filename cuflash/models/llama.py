"""flash-attn 2.8's Llama checkpoint helpers (``flash_attn.models.llama``): a Hugging Face Llama
runs as ``cuflash.models.gpt.GPTLMHeadModel`` with ``llama_config_to_gpt2_config(llama_config)``
and ``remap_state_dict_hf_llama(state_dict, config)``; ``inv_remap_state_dict_hf_llama`` goes
back. transformers is not needed: any object with LlamaConfig's attribute names is a Llama
config.

The rotary layout: Hugging Face's Llama checkpoints hold q_proj / k_proj with each head's rows
permuted for the half-split rotary (feature i paired with i + head_dim / 2), Meta's original
layout pairs features 2i, 2i + 1; the remap undoes the permutation and the converted config
sets ``rotary_emb_interleaved=True``, so the model pairs features as Meta's layout does (the
same attention as the Hugging Face model).

Differences from flash-attn (on the accepting side): k_proj's permutation uses the key heads'
count (``num_key_value_heads``), so GQA checkpoints remap (flash-attn's reshape assumes as many
key heads as query heads); ``rotary_emb_base`` comes from ``rope_theta`` (Hugging Face's name;
flash-attn reads ``rotary_emb_base``, absent from LlamaConfig, so always 10000);
``tie_word_embeddings`` is the Llama config's (flash-attn's is always False); a ``head_dim``
other than ``hidden_size / num_attention_heads`` and ``rope_scaling`` raise
``cuflash.UnsupportedFeature`` (neither fits this model's rotary).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..api import UnsupportedFeature
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_llama", "inv_remap_state_dict_hf_llama", "llama_config_to_gpt2_config"]


def _heads(config):
    n_embd, n_head = _get(config, "n_embd"), _get(config, "n_head")
    n_head_kv = _get(config, "n_head_kv", None) or n_head
    return n_embd, n_head, n_head_kv, n_embd // n_head


def _half_to_pairs(w, heads, head_dim):
    """Each head's rows from the half-split rotary order (i, i + d/2) to the paired order
    (2i, 2i + 1): row (h, half, i) → row (h, i, half)."""
    return w.reshape(heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(heads * head_dim, *w.shape[1:])


def _pairs_to_half(w, heads, head_dim):
    """The inverse of _half_to_pairs."""
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(heads * head_dim, *w.shape[1:])


def _pad_vocab(weight, config):
    """weight's rows padded with zeros up to a multiple of pad_vocab_size_multiple."""
    multiple = _get(config, "pad_vocab_size_multiple", 1)
    rows = math.ceil(weight.shape[0] / multiple) * multiple
    return F.pad(weight, (0, 0, 0, rows - weight.shape[0]))


_HF_LAYER = {"input_layernorm.weight": "norm1.weight", "post_attention_layernorm.weight": "norm2.weight",
             "mlp.down_proj.weight": "mlp.fc2.weight", "self_attn.o_proj.weight": "mixer.out_proj.weight",
             "self_attn.o_proj.bias": "mixer.out_proj.bias"}


def remap_state_dict_hf_llama(state_dict, config):
    """A Hugging Face Llama state dict (``model.embed_tokens``, ``model.layers.{i}.*``,
    ``model.norm``, ``lm_head``) → GPTLMHeadModel's keys for ``config`` (a GPT2Config from
    llama_config_to_gpt2_config): Wqkv = [q_proj; k_proj; v_proj] with q and k rows in the paired
    rotary order (see the module docstring), fc1 = [up_proj; gate_proj] (GatedMlp's y, then its
    gate), fc2 = down_proj, norm1 / norm2 / ln_f the RMSNorm weights, the embedding and lm_head
    padded to pad_vocab_size_multiple (lm_head the embedding with tie_word_embeddings), the
    rotary inv_freq buffers dropped. Returns a new OrderedDict."""
    n_embd, n_head, n_head_kv, head_dim = _heads(config)
    sd = OrderedDict(state_dict)
    out = OrderedDict()
    embed = _pad_vocab(sd.pop("model.embed_tokens.weight"), config)
    out["transformer.embeddings.word_embeddings.weight"] = embed
    head = sd.pop("lm_head.weight", None)
    if _get(config, "tie_word_embeddings"):
        out["lm_head.weight"] = embed
    else:
        if head is None:
            raise ValueError("remap_state_dict_hf_llama: lm_head.weight is missing and config.tie_word_embeddings "
                             "is False")
        out["lm_head.weight"] = _pad_vocab(head, config)
    out["transformer.ln_f.weight"] = sd.pop("model.norm.weight")
    for l in range(_get(config, "n_layer")):
        p, q = f"model.layers.{l}.", f"transformer.layers.{l}."
        for kind in ("weight", "bias"):
            parts = [sd.pop(f"{p}self_attn.{name}_proj.{kind}", None) for name in "qkv"]
            if all(part is None for part in parts):
                continue
            if any(part is None for part in parts):
                raise ValueError(f"remap_state_dict_hf_llama: layer {l} has some of q_proj / k_proj / v_proj.{kind} "
                                 "but not all")
            wq, wk, wv = parts
            out[f"{q}mixer.Wqkv.{kind}"] = torch.cat([_half_to_pairs(wq, n_head, head_dim),
                                                      _half_to_pairs(wk, n_head_kv, head_dim), wv], dim=0)
        out[f"{q}mlp.fc1.weight"] = torch.cat([sd.pop(f"{p}mlp.up_proj.weight"), sd.pop(f"{p}mlp.gate_proj.weight")])
        for src, dst in _HF_LAYER.items():
            if p + src in sd:
                out[q + dst] = sd.pop(p + src)
        sd.pop(f"{p}self_attn.rotary_emb.inv_freq", None)
    sd.pop("model.rotary_emb.inv_freq", None)
    if sd:
        raise ValueError(f"remap_state_dict_hf_llama: keys not mapped: {sorted(sd)[:8]}"
                         f"{' ...' if len(sd) > 8 else ''} (config.n_layer = {_get(config, 'n_layer')})")
    return out


def inv_remap_state_dict_hf_llama(state_dict, config):
    """GPTLMHeadModel's state dict → Hugging Face Llama keys: the inverse of
    remap_state_dict_hf_llama (the padded vocabulary rows stay). Returns a new OrderedDict."""
    n_embd, n_head, n_head_kv, head_dim = _heads(config)
    sd = OrderedDict(state_dict)
    out = OrderedDict()
    out["model.embed_tokens.weight"] = sd.pop("transformer.embeddings.word_embeddings.weight")
    head = sd.pop("lm_head.weight", None)
    if head is not None and not _get(config, "tie_word_embeddings"):
        out["lm_head.weight"] = head
    out["model.norm.weight"] = sd.pop("transformer.ln_f.weight")
    inverse = {v: k for k, v in _HF_LAYER.items()}
    for l in range(_get(config, "n_layer")):
        p, q = f"model.layers.{l}.", f"transformer.layers.{l}."
        for kind in ("weight", "bias"):
            wqkv = sd.pop(f"{q}mixer.Wqkv.{kind}", None)
            if wqkv is None:
                continue
            wq, wk, wv = wqkv.split([n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim])
            out[f"{p}self_attn.q_proj.{kind}"] = _pairs_to_half(wq, n_head, head_dim)
            out[f"{p}self_attn.k_proj.{kind}"] = _pairs_to_half(wk, n_head_kv, head_dim)
            out[f"{p}self_attn.v_proj.{kind}"] = wv
        up, gate = sd.pop(f"{q}mlp.fc1.weight").chunk(2, dim=0)
        out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate, up
        for src, dst in inverse.items():
            if q + src in sd:
                out[p + dst] = sd.pop(q + src)
    if sd:
        raise ValueError(f"inv_remap_state_dict_hf_llama: keys not mapped: {sorted(sd)[:8]}")
    return out


def llama_config_to_gpt2_config(llama_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a Llama config (LlamaConfig's attribute names:
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    intermediate_size, rms_norm_eps, rope_theta, ...): no position embedding, SwiGLU MLP of
    intermediate_size, RMSNorm, full-width interleaved rotary (see the module docstring), no
    biases (attention_bias: q / k / v / o biases), no dropout."""
    def need(name):
        if not hasattr(llama_config, name):
            raise ValueError(f"llama_config.{name} is missing (LlamaConfig's attribute names are needed)")
        return getattr(llama_config, name)

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = getattr(llama_config, "head_dim", None)
    if head_dim is not None and head_dim != hidden // heads:
        raise UnsupportedFeature(f"llama_config.head_dim = {head_dim} differs from hidden_size / num_attention_heads "
                                 f"= {hidden // heads}")
    if getattr(llama_config, "rope_scaling", None):
        raise UnsupportedFeature(f"llama_config.rope_scaling = {llama_config.rope_scaling!r}: scaled rotary "
                                 "embeddings are not part of cuflash's MHA")
    attention_bias = bool(getattr(llama_config, "attention_bias", False))
    base = getattr(llama_config, "rope_theta", None) or getattr(llama_config, "rotary_emb_base", 10000.0)
    return GPT2Config(
        vocab_size=need("vocab_size"), n_positions=0, n_embd=hidden, n_layer=need("num_hidden_layers"), n_head=heads,
        n_inner=need("intermediate_size"), activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, layer_norm_epsilon=need("rms_norm_eps"),
        initializer_range=getattr(llama_config, "initializer_range", 0.02),
        bos_token_id=getattr(llama_config, "bos_token_id", None), eos_token_id=getattr(llama_config, "eos_token_id", None),
        pad_token_id=getattr(llama_config, "pad_token_id", None), rms_norm=True, rotary_emb_fraction=1.0,
        rotary_emb_interleaved=True, rotary_emb_base=float(base),
        tie_word_embeddings=bool(getattr(llama_config, "tie_word_embeddings", False)),
        qkv_proj_bias=attention_bias, out_proj_bias=attention_bias, mlp_fc1_bias=False, mlp_fc2_bias=False,
        n_head_kv=getattr(llama_config, "num_key_value_heads", None))
