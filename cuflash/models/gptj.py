"""flash-attn 2.8's GPT-J checkpoint helpers (``flash_attn.models.gptj``): a Hugging Face GPT-J
runs as ``cuflash.models.gpt.GPTLMHeadModel`` with ``gptj_config_to_gpt2_config(gptj_config)``
and ``remap_state_dict_hf_gptj(state_dict, config)``. transformers is not needed: any object
with GPTJConfig's attribute names is a config.

The model: no position embedding, partial rotary (``rotary_dim`` features of each head, pairs
2i, 2i + 1: interleaved), parallel blocks with one norm (``ln_1``) for attention and MLP, no
attention biases, tanh-GELU MLP, an untied ``lm_head`` with a bias.

Difference from flash-attn: the config sets ``lm_head_bias=True`` and the remap keeps
``lm_head.bias`` (Hugging Face's GPT-J head has one); ``rotary_dim=None`` means the whole head.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ._hf import attr, pad_embeddings_and_head, pop, rename
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_gptj", "gptj_config_to_gpt2_config"]

_TABLE = [
    (r"transformer\.wte\.weight", r"transformer.embeddings.word_embeddings.weight"),
    (r"lm_head\.(weight|bias)", r"lm_head.\1"),
    (r"transformer\.ln_f\.(weight|bias)", r"transformer.ln_f.\1"),
    (r"transformer\.h\.(\d+)\.ln_1\.(weight|bias)", r"transformer.layers.\1.norm1.\2"),
    (r"transformer\.h\.(\d+)\.attn\.(q|k|v)_proj\.weight", r"transformer.layers.\1.mixer.W\2.weight"),
    (r"transformer\.h\.(\d+)\.attn\.out_proj\.weight", r"transformer.layers.\1.mixer.out_proj.weight"),
    (r"transformer\.h\.(\d+)\.mlp\.fc_in\.(weight|bias)", r"transformer.layers.\1.mlp.fc1.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.fc_out\.(weight|bias)", r"transformer.layers.\1.mlp.fc2.\2"),
]
_DROP = [r"transformer\.h\.\d+\.attn\.(bias|masked_bias|embed_positions)"]


def remap_state_dict_hf_gptj(state_dict, config):
    """A Hugging Face GPT-J state dict (``transformer.wte``, ``transformer.h.{i}.ln_1 /
    attn.q_proj / k_proj / v_proj / out_proj / mlp.fc_in / mlp.fc_out``, ``transformer.ln_f``,
    ``lm_head``) → GPTLMHeadModel's keys: Wqkv = [q_proj; k_proj; v_proj], the vocabulary padded
    to pad_vocab_size_multiple (the lm_head bias with zeros), the mask buffers dropped. Returns a
    new OrderedDict."""
    who = "remap_state_dict_hf_gptj"
    sd = rename(state_dict, _TABLE, who, drop=_DROP)
    pad_embeddings_and_head(sd, config, who)
    for l in range(_get(config, "n_layer")):
        p = f"transformer.layers.{l}.mixer."
        sd[p + "Wqkv.weight"] = torch.cat([pop(sd, f"{p}W{n}.weight", who) for n in "qkv"])
    return OrderedDict(sd)


def gptj_config_to_gpt2_config(gptj_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a GPT-J config (GPTJConfig's attribute names: vocab_size,
    n_embd, n_layer, n_head, n_inner, rotary_dim, activation_function, resid_pdrop, embd_pdrop,
    attn_pdrop, layer_norm_epsilon, tie_word_embeddings)."""
    c, who = gptj_config, "gptj_config"
    n_embd, n_head = attr(c, ("n_embd", "hidden_size"), who), attr(c, ("n_head", "num_attention_heads"), who)
    head_dim = n_embd // n_head
    rotary_dim = attr(c, "rotary_dim", who, None) or head_dim
    act = attr(c, "activation_function", who, "gelu_new")
    return GPT2Config(
        vocab_size=attr(c, "vocab_size", who), n_positions=0, n_embd=n_embd,
        n_layer=attr(c, ("n_layer", "num_hidden_layers"), who), n_head=n_head, n_inner=attr(c, "n_inner", who, None),
        activation_function="gelu_new" if act == "gelu_pytorch_tanh" else act,
        resid_pdrop=attr(c, "resid_pdrop", who, 0.0), embd_pdrop=attr(c, "embd_pdrop", who, 0.0),
        attn_pdrop=attr(c, "attn_pdrop", who, 0.0), layer_norm_epsilon=attr(c, "layer_norm_epsilon", who, 1e-5),
        initializer_range=attr(c, "initializer_range", who, 0.02), bos_token_id=attr(c, "bos_token_id", who, None),
        eos_token_id=attr(c, "eos_token_id", who, None), prenorm=True, parallel_block=True,
        parallel_block_tied_norm=True, rotary_emb_fraction=rotary_dim / head_dim, rotary_emb_interleaved=True,
        tie_word_embeddings=bool(attr(c, "tie_word_embeddings", who, False)), lm_head_bias=True,
        qkv_proj_bias=False, out_proj_bias=False)
