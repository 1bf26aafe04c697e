"""flash-attn 2.8's OPT checkpoint helpers (``flash_attn.models.opt``): a Hugging Face OPT runs as
``cuflash.models.gpt.GPTLMHeadModel`` with ``opt_config_to_gpt2_config(opt_config)`` and
``remap_state_dict_hf_opt(state_dict, config)``. transformers is not needed: any object with
OPTConfig's attribute names is a config.

The model: learned absolute positions (OPT's table has two extra leading rows, an offset of 2
for its padding convention; the remap drops them, so position i reads OPT's row i + 2, which is
what OPT reads for unpadded inputs), pre-norm blocks (post-norm without ``do_layer_norm_before``,
OPT-350m, which also has no final norm), ReLU MLP of ``ffn_dim``, the LM head tied to the word
embedding; OPT-350m's ``word_embed_proj_dim`` (``project_in`` / ``project_out``).

Differences from flash-attn (on the accepting side): ``enable_bias=False`` turns the biases off;
``layerdrop != 0`` and ``layer_norm_elementwise_affine=False`` raise ``ValueError`` naming them
(flash-attn asserts).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ._hf import attr, pad_rows, padded_vocab, pop, rename
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_opt", "opt_config_to_gpt2_config"]

_P = r"(?:model\.)?decoder\."
_TABLE = [
    (_P + r"embed_tokens\.weight", r"transformer.embeddings.word_embeddings.weight"),
    (_P + r"embed_positions\.weight", r"transformer.embeddings.position_embeddings.weight"),
    (_P + r"project_in\.weight", r"transformer.embeddings.project_in.weight"),
    (_P + r"project_out\.weight", r"project_out.weight"),
    (_P + r"(?:final_)?layer_norm\.(weight|bias)", r"transformer.ln_f.\1"),
    (_P + r"layers\.(\d+)\.self_attn_layer_norm\.(weight|bias)", r"transformer.layers.\1.norm1.\2"),
    (_P + r"layers\.(\d+)\.final_layer_norm\.(weight|bias)", r"transformer.layers.\1.norm2.\2"),
    (_P + r"layers\.(\d+)\.fc(1|2)\.(weight|bias)", r"transformer.layers.\1.mlp.fc\2.\3"),
    (_P + r"layers\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)", r"transformer.layers.\1.mixer.W\2.\3"),
    (_P + r"layers\.(\d+)\.self_attn\.out_proj\.(weight|bias)", r"transformer.layers.\1.mixer.out_proj.\2"),
    (r"lm_head\.weight", None),           # tied to the word embedding
]

OFFSET = 2     # OPT's learned position table starts two rows in


def remap_state_dict_hf_opt(state_dict, config):
    """A Hugging Face OPT state dict (``model.decoder.embed_tokens / embed_positions /
    project_in / project_out / layers.{i}.self_attn_layer_norm / self_attn.q_proj / k_proj / v_proj
    / out_proj / final_layer_norm / fc1 / fc2``, ``model.decoder.final_layer_norm`` (or
    ``layer_norm``), with or without ``model.``) → GPTLMHeadModel's keys: Wqkv = [q; k; v], the
    position table without its first two rows, the word embedding padded to
    pad_vocab_size_multiple and shared by lm_head. Returns a new OrderedDict."""
    who = "remap_state_dict_hf_opt"
    sd = rename(state_dict, _TABLE, who)
    word = "transformer.embeddings.word_embeddings.weight"
    sd[word] = pad_rows(pop(sd, word, who), padded_vocab(config))
    sd["lm_head.weight"] = sd[word]
    pos = "transformer.embeddings.position_embeddings.weight"
    sd[pos] = pop(sd, pos, who)[OFFSET:]
    for l in range(_get(config, "n_layer")):
        p = f"transformer.layers.{l}.mixer."
        for kind in ("weight", "bias"):
            parts = [sd.pop(f"{p}W{n}.{kind}", None) for n in "qkv"]
            if all(t is not None for t in parts):
                sd[f"{p}Wqkv.{kind}"] = torch.cat(parts)
            elif any(t is not None for t in parts):
                raise ValueError(f"{who}: layer {l} has some of q_proj / k_proj / v_proj.{kind} but not all")
    return OrderedDict(sd)


def opt_config_to_gpt2_config(opt_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of an OPT config (OPTConfig's attribute names: vocab_size,
    max_position_embeddings, hidden_size, num_hidden_layers, num_attention_heads, ffn_dim,
    activation_function, dropout, attention_dropout, init_std, do_layer_norm_before,
    word_embed_proj_dim, enable_bias, layerdrop, layer_norm_elementwise_affine)."""
    c, who = opt_config, "opt_config"
    if attr(c, "layerdrop", who, 0.0) != 0.0:
        raise ValueError(f"opt_config.layerdrop must be 0 (dropping layers is not part of GPTModel), got "
                         f"{c.layerdrop!r}")
    if not attr(c, "layer_norm_elementwise_affine", who, True):
        raise ValueError("opt_config.layer_norm_elementwise_affine must be True (the norms have weights and biases)")
    hidden = attr(c, "hidden_size", who)
    proj = attr(c, "word_embed_proj_dim", who, None)
    bias = bool(attr(c, "enable_bias", who, True))
    return GPT2Config(
        vocab_size=attr(c, "vocab_size", who), n_positions=attr(c, "max_position_embeddings", who), n_embd=hidden,
        n_layer=attr(c, "num_hidden_layers", who), n_head=attr(c, "num_attention_heads", who),
        n_inner=attr(c, "ffn_dim", who), activation_function=attr(c, "activation_function", who, "relu"),
        resid_pdrop=attr(c, "dropout", who, 0.1), embd_pdrop=attr(c, "dropout", who, 0.1),
        attn_pdrop=attr(c, "attention_dropout", who, 0.0), initializer_range=attr(c, "init_std", who, 0.02),
        bos_token_id=attr(c, "bos_token_id", who, None), eos_token_id=attr(c, "eos_token_id", who, None),
        prenorm=bool(attr(c, "do_layer_norm_before", who, True)),
        word_embed_proj_dim=None if proj in (None, hidden) else proj,
        tie_word_embeddings=True, qkv_proj_bias=bias, out_proj_bias=bias, mlp_fc1_bias=bias, mlp_fc2_bias=bias)
