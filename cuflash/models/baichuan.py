"""flash-attn 2.8's Baichuan checkpoint helpers (``flash_attn.models.baichuan``): a Hugging Face
Baichuan / Baichuan 2 model runs as ``cuflash.models.gpt.GPTLMHeadModel`` with
``baichuan_config_to_gpt2_config(baichuan_config)`` and ``remap_state_dict_hf_baichuan(state_dict,
config)``. transformers is not needed: any object with BaichuanConfig's attribute names is a
config.

The model: Llama's layout (RMSNorm pre-norm blocks, SwiGLU MLP of ``intermediate_size``, no
biases, no position embedding, an untied ``lm_head``) with a fused ``W_pack`` projection (q, k, v
rows, each ``hidden_size``, taken as Wqkv as it is) and either
* rotary embeddings (Baichuan-7B, Baichuan2-7B): full-width, half-split pairs (i, i + d/2), or
* ALiBi (Baichuan-13B, Baichuan2-13B): ``get_alibi_slopes(n_head)``, Baichuan's slopes (its
  bias ``slope · key position`` differs from ALiBi's ``-slope · (query - key)`` by a constant per
  query row, which the softmax cancels); the converted config sets ``use_flash_attn=True``
  (cuflash's kernels take the slopes; the torch attention has no ALiBi).
Baichuan 2 normalizes the lm_head rows in the forward (``NormHead``): ``norm_head=True``.

As in flash-attn, the configs do not say which of these a checkpoint is: rotary when
``hidden_size < 5000`` (7B), else ALiBi (13B); ``norm_head`` when ``vocab_size > 70000``
(Baichuan 2's 125,696-token vocabulary). Differences from flash-attn (on the accepting side): a
config attribute ``use_alibi`` / ``norm_head`` overrides the inference; ``mlp_multiple_of=1``
(any ``intermediate_size`` loads; flash-attn's default 128 fits the released sizes);
``tie_word_embeddings`` is read from the config (default False, Baichuan's); ``hidden_act`` other
than silu raises ``ValueError`` naming it.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ._hf import attr, pad_embeddings_and_head, pop, rename
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_baichuan", "baichuan_config_to_gpt2_config"]

_L = r"model\.layers\.(\d+)\."
_TABLE = [
    (r"model\.embed_tokens\.weight", r"transformer.embeddings.word_embeddings.weight"),
    (r"lm_head\.weight", r"lm_head.weight"),
    (r"model\.norm\.weight", r"transformer.ln_f.weight"),
    (_L + r"input_layernorm\.weight", r"transformer.layers.\1.norm1.weight"),
    (_L + r"post_attention_layernorm\.weight", r"transformer.layers.\1.norm2.weight"),
    (_L + r"self_attn\.W_pack\.weight", r"transformer.layers.\1.mixer.Wqkv.weight"),
    (_L + r"self_attn\.o_proj\.weight", r"transformer.layers.\1.mixer.out_proj.weight"),
    (_L + r"mlp\.(gate_proj|up_proj)\.weight", r"transformer.layers.\1.mlp.\2.weight"),   # fused below
    (_L + r"mlp\.down_proj\.weight", r"transformer.layers.\1.mlp.fc2.weight"),
]
_DROP = [_L + r"self_attn\.rotary_emb\.inv_freq"]


def remap_state_dict_hf_baichuan(state_dict, config):
    """A Hugging Face Baichuan state dict (``model.embed_tokens``, ``model.layers.{i}.
    input_layernorm / self_attn.W_pack / self_attn.o_proj / post_attention_layernorm /
    mlp.gate_proj / mlp.up_proj / mlp.down_proj``, ``model.norm``, ``lm_head``) → GPTLMHeadModel's
    keys for ``config`` (from baichuan_config_to_gpt2_config): Wqkv = W_pack, fc1 = [up_proj;
    gate_proj] (GatedMlp's y, then its gate), the word embedding and lm_head padded to
    pad_vocab_size_multiple (lm_head the word embedding with tie_word_embeddings), the rotary
    buffers dropped. A key nothing maps raises ValueError naming it. Returns a new OrderedDict."""
    who = "remap_state_dict_hf_baichuan"
    sd = rename(state_dict, _TABLE, who, drop=_DROP)
    pad_embeddings_and_head(sd, config, who)
    for l in range(_get(config, "n_layer")):
        p = f"transformer.layers.{l}.mlp."
        up, gate = pop(sd, p + "up_proj.weight", who), pop(sd, p + "gate_proj.weight", who)
        sd[p + "fc1.weight"] = torch.cat([up, gate], dim=0)
    return OrderedDict(sd)


def baichuan_config_to_gpt2_config(baichuan_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a Baichuan config (BaichuanConfig's attribute names:
    vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    hidden_act, rms_norm_eps, initializer_range, bos / eos / pad_token_id, tie_word_embeddings;
    optional overrides use_alibi, norm_head). See the module docstring for rotary vs ALiBi."""
    c, who = baichuan_config, "baichuan_config"
    hidden = attr(c, "hidden_size", who)
    vocab = attr(c, "vocab_size", who)
    act = attr(c, "hidden_act", who, "silu")
    if act != "silu":
        raise ValueError(f"baichuan_config.hidden_act must be 'silu' (SwiGLU), got {act!r}")
    use_alibi = bool(attr(c, "use_alibi", who, hidden >= 5000))
    return GPT2Config(
        vocab_size=vocab, n_positions=0, n_embd=hidden, n_layer=attr(c, "num_hidden_layers", who),
        n_head=attr(c, "num_attention_heads", who), n_inner=attr(c, "intermediate_size", who),
        activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=attr(c, "rms_norm_eps", who), initializer_range=attr(c, "initializer_range", who, 0.02),
        bos_token_id=attr(c, "bos_token_id", who, None), eos_token_id=attr(c, "eos_token_id", who, None),
        pad_token_id=attr(c, "pad_token_id", who, None), rms_norm=True,
        rotary_emb_fraction=0.0 if use_alibi else 1.0, rotary_emb_interleaved=False, use_alibi=use_alibi,
        use_flash_attn=use_alibi, tie_word_embeddings=bool(attr(c, "tie_word_embeddings", who, False)),
        norm_head=bool(attr(c, "norm_head", who, vocab > 70000)), qkv_proj_bias=False, out_proj_bias=False,
        mlp_fc1_bias=False, mlp_fc2_bias=False, mlp_multiple_of=1)
