"""flash-attn 2.8's BigCode (StarCoder / SantaCoder, GPTBigCode) checkpoint helpers
(``flash_attn.models.bigcode``): a Hugging Face GPTBigCode runs as
``cuflash.models.gpt.GPTLMHeadModel`` with ``bigcode_config_to_gpt2_config(bigcode_config)`` and
``remap_state_dict_hf_bigcode(state_dict, config)``; ``inv_remap_state_dict_hf_bigcode`` goes
back. transformers is not needed: any object with GPTBigCodeConfig's attribute names is a
config.

The model: GPT-2's (learned positions, pre-norm LayerNorm blocks, tanh-GELU MLP, LM head tied to
the word embedding) with multi-query attention (``multi_query``: one key / value head, the
fused ``c_attn`` rows q (n_embd), k (head_dim), v (head_dim)) or multi-head (per-head q, k, v
rows). GPTBigCode's linears are ``nn.Linear`` (no Conv1D transpose).

Difference from flash-attn: multi-query stays multi-query (``n_head_kv = 1``: the model keeps one
kv head and cuflash's kernels run MQA); flash-attn tiles k and v to every head (plain MHA with
n_head identical kv heads: the same outputs, n_head times the kv projection).
``inv_remap_state_dict_hf_bigcode`` also takes flash-attn's tiled layout (it keeps the first
head's k / v). ``multi_query=False`` checkpoints are remapped too (flash-attn asserts).
"""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from ._hf import attr, pad_rows, padded_vocab, pop, rename
from .gpt import GPT2Config, _get
from .gpt_neox import per_head_to_grouped

__all__ = ["remap_state_dict_hf_bigcode", "inv_remap_state_dict_hf_bigcode", "bigcode_config_to_gpt2_config"]

_NAMES = [("ln_1.", "norm1."), ("ln_2.", "norm2."), ("attn.c_attn.", "mixer.Wqkv."),
          ("attn.c_proj.", "mixer.out_proj."), ("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2.")]
_TABLE = ([(r"transformer\.wte\.weight", r"transformer.embeddings.word_embeddings.weight"),
           (r"transformer\.wpe\.weight", r"transformer.embeddings.position_embeddings.weight"),
           (r"transformer\.ln_f\.(weight|bias)", r"transformer.ln_f.\1"),
           (r"lm_head\.weight", None)]             # tied to the word embedding
          + [(r"transformer\.h\.(\d+)\." + re.escape(a) + r"(weight|bias)", r"transformer.layers.\1." + b + r"\2")
             for a, b in _NAMES])
_DROP = [r"transformer\.bias", r"transformer\.h\.\d+\.attn\.masked_bias"]


def _multi_query(config) -> bool:
    return _get(config, "n_head_kv", None) == 1


def remap_state_dict_hf_bigcode(state_dict, config):
    """A Hugging Face GPTBigCode state dict (``transformer.wte / wpe / h.{i}.ln_1 / attn.c_attn /
    attn.c_proj / ln_2 / mlp.c_fc / mlp.c_proj / ln_f``) → GPTLMHeadModel's keys for ``config``
    (from bigcode_config_to_gpt2_config): multi-query c_attn is already Wqkv's layout (q heads,
    the key head, the value head); multi-head c_attn's per-head rows are regrouped; the word
    embedding padded to pad_vocab_size_multiple and shared by lm_head. Returns a new
    OrderedDict."""
    who = "remap_state_dict_hf_bigcode"
    sd = rename(state_dict, _TABLE, who, drop=_DROP)
    word = "transformer.embeddings.word_embeddings.weight"
    sd[word] = pad_rows(pop(sd, word, who), padded_vocab(config))
    sd["lm_head.weight"] = sd[word]
    if not _multi_query(config):
        for l in range(_get(config, "n_layer")):
            for kind in ("weight", "bias"):
                key = f"transformer.layers.{l}.mixer.Wqkv.{kind}"
                if key in sd:
                    sd[key] = per_head_to_grouped(sd[key], _get(config, "n_head"))
    return OrderedDict(sd)


def inv_remap_state_dict_hf_bigcode(state_dict, config):
    """GPTLMHeadModel's state dict → Hugging Face GPTBigCode keys: the inverse of
    remap_state_dict_hf_bigcode (the vocabulary cut back to config.vocab_size; flash-attn's tiled
    multi-query Wqkv, 3 · n_embd rows, reduced to the first head's k and v). Returns a new
    OrderedDict."""
    who = "inv_remap_state_dict_hf_bigcode"
    vocab = _get(config, "vocab_size")
    n_embd, n_head = _get(config, "n_embd"), _get(config, "n_head")
    head_dim = n_embd // n_head
    inverse = [(r"transformer\.embeddings\.word_embeddings\.weight", r"transformer.wte.weight"),
               (r"transformer\.embeddings\.position_embeddings\.weight", r"transformer.wpe.weight"),
               (r"transformer\.ln_f\.(weight|bias)", r"transformer.ln_f.\1"), (r"lm_head\.weight", None)]
    inverse += [(r"transformer\.layers\.(\d+)\." + re.escape(b) + r"(weight|bias)", r"transformer.h.\1." + a + r"\2")
                for a, b in _NAMES]
    sd = rename(state_dict, inverse, who)
    sd["transformer.wte.weight"] = pop(sd, "transformer.wte.weight", who)[:vocab]
    for l in range(_get(config, "n_layer")):
        for kind in ("weight", "bias"):
            key = f"transformer.h.{l}.attn.c_attn.{kind}"
            if key not in sd:
                continue
            w = sd[key]
            if _multi_query(config):
                if w.shape[0] == 3 * n_embd:          # flash-attn's tiled k / v
                    q, k, v = w.split(n_embd)
                    w = torch.cat([q, k[:head_dim], v[:head_dim]])
            else:
                w = w.reshape(3, n_head, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
            sd[key] = w
    return OrderedDict(sd)


def bigcode_config_to_gpt2_config(bigcode_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a GPTBigCode config (GPT-2's attribute names plus
    multi_query): n_head_kv = 1 with multi_query."""
    c, who = bigcode_config, "bigcode_config"
    act = attr(c, "activation_function", who, "gelu_pytorch_tanh")
    return GPT2Config(
        vocab_size=attr(c, "vocab_size", who), n_positions=attr(c, ("n_positions", "max_position_embeddings"), who),
        n_embd=attr(c, ("n_embd", "hidden_size"), who), n_layer=attr(c, ("n_layer", "num_hidden_layers"), who),
        n_head=attr(c, ("n_head", "num_attention_heads"), who), n_inner=attr(c, "n_inner", who, None),
        activation_function="gelu_new" if act == "gelu_pytorch_tanh" else act,
        resid_pdrop=attr(c, "resid_pdrop", who, 0.1), embd_pdrop=attr(c, "embd_pdrop", who, 0.1),
        attn_pdrop=attr(c, "attn_pdrop", who, 0.1), layer_norm_epsilon=attr(c, "layer_norm_epsilon", who, 1e-5),
        initializer_range=attr(c, "initializer_range", who, 0.02),
        scale_attn_weights=bool(attr(c, "scale_attn_weights", who, True)),
        bos_token_id=attr(c, "bos_token_id", who, None), eos_token_id=attr(c, "eos_token_id", who, None),
        n_head_kv=1 if attr(c, "multi_query", who, True) else None, tie_word_embeddings=True)
