"""flash-attn 2.8's Falcon checkpoint helpers (``flash_attn.models.falcon``): a Hugging Face
Falcon runs as ``cuflash.models.gpt.GPTLMHeadModel`` with ``falcon_config_to_gpt2_config(
falcon_config)`` and ``remap_state_dict_hf_falcon(state_dict, config)``. transformers is not
needed: any object with FalconConfig's attribute names (the current ones or the older
``n_head`` / ``n_layer`` / ``n_head_kv``) is a config.

The model: no position embedding, full-width rotary (half-split pairs) or, with ``alibi=True``
(Falcon-RW), ALiBi instead of rotary, GELU MLP of 4 × hidden (``ffn_hidden_size`` when set), the
LM head tied to the word embedding, and one of
* Falcon-7B: multi-query attention (one kv head), parallel attention and MLP on one norm
  (``input_layernorm``: tied norms);
* the new decoder architecture (Falcon-40B / 180B): ``num_kv_heads`` kv heads (GQA), parallel
  attention and MLP on their own norms (``ln_attn``, ``ln_mlp``);
* ``parallel_attn=False``: sequential pre-norm blocks (``input_layernorm``,
  ``post_attention_layernorm``).
The fused ``query_key_value`` rows come in kv groups (each group's query heads, then its key
head, then its value head); the remap regroups them as Wqkv's q-then-k-then-v.

Differences from flash-attn: the norm layout is read from ``new_decoder_architecture`` /
``num_ln_in_parallel_attn`` when the config has them (flash-attn infers it from the kv head
count); ``rope_theta``, ``ffn_hidden_size`` and ``tie_word_embeddings`` are read;
``alibi=True`` (flash-attn ignores it and keeps rotary) gives Hugging Face Falcon's ALiBi: the
bias ``slope · key position`` is added to the raw scores q·k and the sum is scaled by
1 / sqrt(head_dim), i.e. ALiBi with the slopes ``get_alibi_slopes(n_head) / sqrt(head_dim)``
(GPT2Config ``use_alibi``, ``alibi_slope_scale``; needs ``use_flash_attn``, which the converted
config sets): Hugging Face's eager attention up to a per-row constant, which the softmax
removes. ``rope_scaling`` raises
``cuflash.UnsupportedFeature``.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..api import UnsupportedFeature
from ._hf import attr, pad_embeddings_and_head, rename
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_falcon", "falcon_config_to_gpt2_config"]

_H = r"transformer\.h\.(\d+)\."
_TABLE = [
    (r"transformer\.word_embeddings\.weight", r"transformer.embeddings.word_embeddings.weight"),
    (r"lm_head\.(weight|bias)", r"lm_head.\1"),
    (r"transformer\.ln_f\.(weight|bias)", r"transformer.ln_f.\1"),
    (_H + r"(?:input_layernorm|ln_attn)\.(weight|bias)", r"transformer.layers.\1.norm1.\2"),
    (_H + r"(?:post_attention_layernorm|ln_mlp)\.(weight|bias)", r"transformer.layers.\1.norm2.\2"),
    (_H + r"self_attention\.query_key_value\.(weight|bias)", r"transformer.layers.\1.mixer.Wqkv.\2"),
    (_H + r"self_attention\.dense\.(weight|bias)", r"transformer.layers.\1.mixer.out_proj.\2"),
    (_H + r"mlp\.dense_h_to_4h\.(weight|bias)", r"transformer.layers.\1.mlp.fc1.\2"),
    (_H + r"mlp\.dense_4h_to_h\.(weight|bias)", r"transformer.layers.\1.mlp.fc2.\2"),
]
_DROP = [_H + r"self_attention\.(rotary_emb\.inv_freq|maybe_rotary\.inv_freq)"]


def kv_groups_to_grouped(w, n_head: int, n_head_kv: int):
    """Rows (n_head_kv, n_head / n_head_kv + 2, head_dim) — each kv group's query heads, its key
    head, its value head — to Wqkv's (all query heads, all key heads, all value heads)."""
    per = n_head // n_head_kv
    g = w.reshape(n_head_kv, per + 2, -1, *w.shape[1:])
    return torch.cat([g[:, :per].flatten(0, 2), g[:, per].flatten(0, 1), g[:, per + 1].flatten(0, 1)])


def remap_state_dict_hf_falcon(state_dict, config):
    """A Hugging Face Falcon state dict (``transformer.word_embeddings``, ``transformer.h.{i}.
    input_layernorm (or ln_attn, ln_mlp, post_attention_layernorm) / self_attention.
    query_key_value / self_attention.dense / mlp.dense_h_to_4h / mlp.dense_4h_to_h``,
    ``transformer.ln_f``, ``lm_head``) → GPTLMHeadModel's keys for ``config`` (a GPT2Config from
    falcon_config_to_gpt2_config: its n_head_kv says the kv groups), the vocabulary padded to
    pad_vocab_size_multiple. Returns a new OrderedDict."""
    who = "remap_state_dict_hf_falcon"
    sd = rename(state_dict, _TABLE, who, drop=_DROP)
    pad_embeddings_and_head(sd, config, who)
    n_head = _get(config, "n_head")
    n_head_kv = _get(config, "n_head_kv", None) or n_head
    for l in range(_get(config, "n_layer")):
        for kind in ("weight", "bias"):
            key = f"transformer.layers.{l}.mixer.Wqkv.{kind}"
            if key in sd:
                sd[key] = kv_groups_to_grouped(sd[key], n_head, n_head_kv)
    return OrderedDict(sd)


def falcon_config_to_gpt2_config(falcon_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a Falcon config (FalconConfig's attribute names:
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_kv_heads, multi_query,
    new_decoder_architecture, num_ln_in_parallel_attn, parallel_attn, bias, alibi, rope_theta,
    layer_norm_epsilon, ffn_hidden_size, activation, hidden_dropout, attention_dropout,
    tie_word_embeddings; or the older n_layer / n_head / n_head_kv)."""
    c, who = falcon_config, "falcon_config"
    alibi = bool(attr(c, "alibi", who, False))
    if getattr(c, "rope_scaling", None):
        raise UnsupportedFeature(f"falcon_config.rope_scaling = {c.rope_scaling!r}: scaled rotary embeddings are not "
                                 "part of cuflash's MHA")
    hidden = attr(c, "hidden_size", who)
    n_head = attr(c, ("num_attention_heads", "n_head"), who)
    new_arch = bool(attr(c, "new_decoder_architecture", who, False))
    if new_arch:
        n_head_kv = attr(c, ("num_kv_heads", "n_head_kv"), who)
    elif hasattr(c, "n_head_kv"):            # the older 40B config
        n_head_kv = c.n_head_kv
    else:
        n_head_kv = 1 if attr(c, "multi_query", who, True) else n_head
    parallel = new_arch or bool(attr(c, "parallel_attn", who, True))
    norms = attr(c, "num_ln_in_parallel_attn", who, None)
    if norms is None:
        norms = 2 if new_arch else (1 if not hasattr(c, "n_head_kv") else (1 if n_head_kv == 1 else 2))
    act = attr(c, "activation", who, "gelu")
    if act != "gelu":
        raise ValueError(f"falcon_config.activation must be 'gelu', got {act!r}")
    bias = bool(attr(c, "bias", who, False))
    if hidden % n_head:
        raise ValueError(f"falcon_config.hidden_size = {hidden} must be divisible by the head count {n_head}")
    # Falcon-RW's ALiBi: (q·k + slope·key position) / sqrt(head_dim), so the slopes scale with the scores
    alibi_kw = dict(use_alibi=True, use_flash_attn=True, alibi_slope_scale=(hidden // n_head) ** -0.5) if alibi else {}
    return GPT2Config(
        vocab_size=attr(c, "vocab_size", who), n_positions=0, n_embd=hidden,
        n_layer=attr(c, ("num_hidden_layers", "n_layer"), who), n_head=n_head,
        n_inner=attr(c, "ffn_hidden_size", who, None) or 4 * hidden, activation_function="gelu",
        resid_pdrop=attr(c, "hidden_dropout", who, 0.0), embd_pdrop=0.0,
        attn_pdrop=attr(c, "attention_dropout", who, 0.0), layer_norm_epsilon=attr(c, "layer_norm_epsilon", who, 1e-5),
        initializer_range=attr(c, "initializer_range", who, 0.02), bos_token_id=attr(c, "bos_token_id", who, None),
        eos_token_id=attr(c, "eos_token_id", who, None), parallel_block=parallel, n_head_kv=n_head_kv,
        parallel_block_tied_norm=parallel and norms == 1, rotary_emb_fraction=0.0 if alibi else 1.0,
        rotary_emb_interleaved=False,
        rotary_emb_base=float(attr(c, "rope_theta", who, 10000.0)),
        tie_word_embeddings=bool(attr(c, "tie_word_embeddings", who, True)), qkv_proj_bias=bias, out_proj_bias=bias,
        mlp_fc1_bias=bias, mlp_fc2_bias=bias, lm_head_bias=False, **alibi_kw)
