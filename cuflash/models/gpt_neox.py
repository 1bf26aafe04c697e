"""flash-attn 2.8's GPT-NeoX checkpoint helpers (``flash_attn.models.gpt_neox``): a Hugging Face
GPT-NeoX / Pythia model runs as ``cuflash.models.gpt.GPTLMHeadModel`` with
``gpt_neox_config_to_gpt2_config(neox_config)`` and ``remap_state_dict_hf_gpt_neox(state_dict,
config)``. transformers is not needed: any object with GPTNeoXConfig's attribute names is a
config.

The model: no position embedding, partial rotary (``rotary_pct`` of each head, the half-split
pairing i, i + d/2, flash-attn's non-interleaved layout), pre-norm LayerNorm blocks, parallel
residual (attention and MLP on their own norms of the same input, ``use_parallel_residual``) or
sequential ones, GELU MLP, an untied ``embed_out`` unless ``tie_word_embeddings``.

Differences from flash-attn (on the accepting side): ``rope_theta`` / ``rotary_emb_base`` is
passed on (flash-attn asserts 10000); ``attention_bias=False`` (newer configs) turns the q / k / v
/ dense biases off; ``rope_scaling`` raises ``cuflash.UnsupportedFeature``; the dropouts are the
config's ``hidden_dropout`` / ``attention_dropout`` when present (flash-attn sets 0).
"""
from __future__ import annotations

from collections import OrderedDict

from ..api import UnsupportedFeature
from ._hf import attr, pad_rows, padded_vocab, pop, rename
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_gpt_neox", "gpt_neox_config_to_gpt2_config"]

_P = r"(?:gpt_neox\.)?"
_TABLE = [
    (_P + r"embed_in\.weight", r"transformer.embeddings.word_embeddings.weight"),
    (r"embed_out\.weight", r"lm_head.weight"),
    (_P + r"final_layer_norm\.(weight|bias)", r"transformer.ln_f.\1"),
    (_P + r"layers\.(\d+)\.input_layernorm\.(weight|bias)", r"transformer.layers.\1.norm1.\2"),
    (_P + r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", r"transformer.layers.\1.norm2.\2"),
    (_P + r"layers\.(\d+)\.attention\.query_key_value\.(weight|bias)", r"transformer.layers.\1.mixer.Wqkv.\2"),
    (_P + r"layers\.(\d+)\.attention\.dense\.(weight|bias)", r"transformer.layers.\1.mixer.out_proj.\2"),
    (_P + r"layers\.(\d+)\.mlp\.dense_h_to_4h\.(weight|bias)", r"transformer.layers.\1.mlp.fc1.\2"),
    (_P + r"layers\.(\d+)\.mlp\.dense_4h_to_h\.(weight|bias)", r"transformer.layers.\1.mlp.fc2.\2"),
]
# the causal-mask and rotary buffers some transformers versions save
_DROP = [_P + r"layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)", _P + r"rotary_emb\.inv_freq"]


def per_head_to_grouped(w, n_head: int):
    """Rows (n_head, 3, head_dim) — each head's q, k, v together, Hugging Face's NeoX / BLOOM
    layout — to (3, n_head, head_dim): all q rows, then all k rows, then all v rows (Wqkv's)."""
    return w.reshape(n_head, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def remap_state_dict_hf_gpt_neox(state_dict, config):
    """A Hugging Face GPT-NeoX state dict (``gpt_neox.embed_in``, ``gpt_neox.layers.{i}.
    input_layernorm / post_attention_layernorm / attention.query_key_value / attention.dense /
    mlp.dense_h_to_4h / mlp.dense_4h_to_h``, ``gpt_neox.final_layer_norm``, ``embed_out``) →
    GPTLMHeadModel's keys for ``config`` (a GPT2Config from gpt_neox_config_to_gpt2_config): the
    fused query_key_value rows from per-head (q, k, v) to Wqkv's q-then-k-then-v, the word
    embedding and lm_head padded to pad_vocab_size_multiple (lm_head the word embedding with
    tie_word_embeddings), the mask / rotary buffers dropped. Returns a new OrderedDict."""
    who = "remap_state_dict_hf_gpt_neox"
    sd = rename(state_dict, _TABLE, who, drop=_DROP)
    vocab = padded_vocab(config)
    word = "transformer.embeddings.word_embeddings.weight"
    sd[word] = pad_rows(pop(sd, word, who), vocab)
    head = sd.pop("lm_head.weight", None)
    if _get(config, "tie_word_embeddings"):
        sd["lm_head.weight"] = sd[word]
    else:
        if head is None:
            raise ValueError(f"{who}: embed_out.weight is missing and config.tie_word_embeddings is False")
        sd["lm_head.weight"] = pad_rows(head, vocab)
    n_head = _get(config, "n_head")
    for l in range(_get(config, "n_layer")):
        for kind in ("weight", "bias"):
            key = f"transformer.layers.{l}.mixer.Wqkv.{kind}"
            if key in sd:
                sd[key] = per_head_to_grouped(sd[key], n_head)
    return OrderedDict(sd)


def _gelu_name(act: str) -> str:
    return "gelu_new" if act == "gelu_pytorch_tanh" else act


def gpt_neox_config_to_gpt2_config(gpt_neox_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a GPT-NeoX config (GPTNeoXConfig's attribute names:
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act,
    rotary_pct, rotary_emb_base / rope_theta, layer_norm_eps, use_parallel_residual,
    tie_word_embeddings, attention_bias)."""
    c, who = gpt_neox_config, "gpt_neox_config"
    if getattr(c, "rope_scaling", None):
        raise UnsupportedFeature(f"gpt_neox_config.rope_scaling = {c.rope_scaling!r}: scaled rotary embeddings are "
                                 "not part of cuflash's MHA")
    bias = bool(attr(c, "attention_bias", who, True))
    return GPT2Config(
        vocab_size=attr(c, "vocab_size", who), n_positions=0, n_embd=attr(c, "hidden_size", who),
        n_layer=attr(c, "num_hidden_layers", who), n_head=attr(c, "num_attention_heads", who),
        n_inner=attr(c, "intermediate_size", who), activation_function=_gelu_name(attr(c, "hidden_act", who, "gelu")),
        resid_pdrop=attr(c, "hidden_dropout", who, 0.0), embd_pdrop=0.0,
        attn_pdrop=attr(c, "attention_dropout", who, 0.0), layer_norm_epsilon=attr(c, "layer_norm_eps", who, 1e-5),
        initializer_range=attr(c, "initializer_range", who, 0.02), bos_token_id=attr(c, "bos_token_id", who, None),
        eos_token_id=attr(c, "eos_token_id", who, None), prenorm=True,
        parallel_block=bool(attr(c, "use_parallel_residual", who, True)), parallel_block_tied_norm=False,
        rotary_emb_fraction=float(attr(c, "rotary_pct", who, 0.25)),
        rotary_emb_base=float(attr(c, ("rope_theta", "rotary_emb_base"), who, 10000.0)),
        rotary_emb_interleaved=False, tie_word_embeddings=bool(attr(c, "tie_word_embeddings", who, False)),
        qkv_proj_bias=bias, out_proj_bias=bias)
