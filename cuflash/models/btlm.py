"""flash-attn 2.8's BTLM checkpoint helpers (``flash_attn.models.btlm``): a Hugging Face Cerebras
BTLM (btlm-3b-8k) runs as ``cuflash.models.gpt.GPTLMHeadModel`` with
``btlm_config_to_gpt2_config(btlm_config)`` and ``remap_state_dict_hf_btlm(state_dict, config)``.
transformers is not needed: any object with BTLMConfig's attribute names is a config.

The model: GPT-2's layout (Conv1D weights, pre-norm LayerNorm blocks, biases, the LM head tied to
the word embedding) with
* ALiBi (``position_embedding_type="alibi"``: no position embedding; the slopes
  ``get_alibi_slopes(n_head)``, the converted config sets ``use_flash_attn=True``), or learned
  positions (``"learned"``);
* a SwiGLU MLP: ``c_fc`` (y) and ``c_fc2`` (gate), y · silu(gate), fused into fc1 = [c_fc; c_fc2]
  (GatedMlp's y, then its gate), hidden size ``n_inner`` as it is (``mlp_multiple_of=1``);
* muP's scale factors: the embeddings times ``mup_embeddings_scale``, the softmax scale
  1 / head_dim (``mup_scale_qk_dot_by_d``), the lm_head input times ``mup_output_alpha ·
  mup_width_scale``.

Differences from flash-attn (on the accepting side): the checkpoint's
``transformer.relative_pe.slopes`` are compared with the slopes the model uses (a mismatch raises
``cuflash.UnsupportedFeature``; flash-attn drops them unread); ``alibi_scaling`` (BTLM's ALiBi
position interpolation, which flash-attn ignores) is read as Hugging Face's BTLM applies it: the
bias is ``-(slope / scale) · |i - j|`` with scale ``factor`` ({"type": "linear", "factor": f};
GPT2Config ``alibi_slope_scale = 1 / f``) or max(1, keys / train_seq_len) for a call with that
many keys ({"type": "linear", "train_seq_len": n}; ``alibi_train_seqlen = n``: the cache plus the
new tokens when decoding, each sequence's own count in a padded or packed batch, where Hugging
Face takes the padded length); ``scale_attn_weights`` /
``scale_attn_by_inverse_layer_idx`` / ``tie_word_embeddings`` are read; the mask buffers
(``attn.bias``, ``attn.masked_bias``) and the tied ``lm_head.weight`` are dropped.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict

import torch

from ..api import UnsupportedFeature
from ..modules.mha import get_alibi_slopes
from ._hf import attr, pad_embeddings_and_head, rename
from .gpt import GPT2Config, _get

__all__ = ["remap_state_dict_hf_btlm", "btlm_config_to_gpt2_config"]

_H = r"transformer\.h\.(\d+)\."
_NAMES = [("ln_1.", "norm1."), ("ln_2.", "norm2."), ("attn.c_attn.", "mixer.Wqkv."),
          ("attn.c_proj.", "mixer.out_proj."), ("mlp.c_fc.", "mlp.c_fc."), ("mlp.c_fc2.", "mlp.c_fc2."),
          ("mlp.c_proj.", "mlp.fc2.")]
_TABLE = ([(r"transformer\.wte\.weight", r"transformer.embeddings.word_embeddings.weight"),
           (r"transformer\.wpe\.weight", r"transformer.embeddings.position_embeddings.weight"),
           (r"transformer\.ln_f\.(weight|bias)", r"transformer.ln_f.\1"),
           (r"lm_head\.weight", r"lm_head.weight"),
           (r"transformer\.relative_pe\.slopes", r"relative_pe.slopes")]
          + [(_H + re.escape(a) + r"(weight|bias)", r"transformer.layers.\1." + b + r"\2") for a, b in _NAMES])
_DROP = [_H + r"attn\.(bias|masked_bias)"]


def remap_state_dict_hf_btlm(state_dict, config):
    """A Hugging Face BTLM state dict (``transformer.wte``, ``transformer.wpe`` (learned positions),
    ``transformer.h.{i}.ln_1 / attn.c_attn / attn.c_proj / ln_2 / mlp.c_fc / mlp.c_fc2 /
    mlp.c_proj``, ``transformer.ln_f``, ``transformer.relative_pe.slopes``, ``lm_head``) →
    GPTLMHeadModel's keys for ``config`` (from btlm_config_to_gpt2_config): the Conv1D weights
    (in, out) transposed, fc1 = [c_fc; c_fc2], the word embedding padded to
    pad_vocab_size_multiple and shared by lm_head, the ALiBi slopes checked against
    get_alibi_slopes(n_head) and dropped. Returns a new OrderedDict."""
    who = "remap_state_dict_hf_btlm"
    sd = rename(state_dict, _TABLE, who, drop=_DROP)
    slopes = sd.pop("relative_pe.slopes", None)
    if slopes is not None:
        want = torch.tensor(get_alibi_slopes(_get(config, "n_head")), dtype=torch.float64)
        got = slopes.detach().to("cpu", torch.float64).flatten()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=0.0):
            raise UnsupportedFeature(f"{who}: the checkpoint's ALiBi slopes (transformer.relative_pe.slopes) differ "
                                     f"from get_alibi_slopes({_get(config, 'n_head')}), the slopes the model uses")
    pad_embeddings_and_head(sd, config, who)
    for l in range(_get(config, "n_layer")):
        p = f"transformer.layers.{l}."
        for name in ("mixer.Wqkv", "mixer.out_proj", "mlp.c_fc", "mlp.c_fc2", "mlp.fc2"):
            if p + name + ".weight" in sd:
                sd[p + name + ".weight"] = sd[p + name + ".weight"].t()      # Conv1D: (in, out)
        for kind in ("weight", "bias"):
            y = sd.pop(p + f"mlp.c_fc.{kind}", None)
            gate = sd.pop(p + f"mlp.c_fc2.{kind}", None)
            if y is None:
                continue
            sd[p + f"mlp.fc1.{kind}"] = y if gate is None else torch.cat([y, gate], dim=0)
    return OrderedDict(sd)


def btlm_config_to_gpt2_config(btlm_config) -> GPT2Config:
    """cuflash.models.gpt.GPT2Config of a BTLM config (BTLMConfig's attribute names: vocab_size,
    n_positions, n_embd, n_layer, n_head, n_inner, activation_function, resid_pdrop, embd_pdrop,
    attn_pdrop, layer_norm_epsilon, initializer_range, scale_attn_weights,
    scale_attn_by_inverse_layer_idx, position_embedding_type, mup_width_scale,
    mup_embeddings_scale, mup_output_alpha, mup_scale_qk_dot_by_d, alibi_scaling; or the generic
    hidden_size / num_hidden_layers / num_attention_heads)."""
    c, who = btlm_config, "btlm_config"
    kind = attr(c, "position_embedding_type", who, "alibi")
    if kind not in ("alibi", "learned"):
        raise ValueError(f"btlm_config.position_embedding_type must be 'alibi' or 'learned', got {kind!r}")
    alibi = kind == "alibi"
    scaling = _alibi_scaling(getattr(c, "alibi_scaling", None)) if alibi else {}
    act = attr(c, "activation_function", who, "swiglu")
    return GPT2Config(
        vocab_size=attr(c, "vocab_size", who),
        n_positions=0 if alibi else attr(c, ("n_positions", "max_position_embeddings"), who),
        n_embd=attr(c, ("n_embd", "hidden_size"), who), n_layer=attr(c, ("n_layer", "num_hidden_layers"), who),
        n_head=attr(c, ("n_head", "num_attention_heads"), who), n_inner=attr(c, "n_inner", who, None),
        activation_function="gelu_new" if act == "gelu_pytorch_tanh" else act,
        resid_pdrop=attr(c, "resid_pdrop", who, 0.0), embd_pdrop=attr(c, "embd_pdrop", who, 0.0),
        attn_pdrop=attr(c, "attn_pdrop", who, 0.0), layer_norm_epsilon=attr(c, "layer_norm_epsilon", who, 1e-5),
        initializer_range=attr(c, "initializer_range", who, 0.02),
        scale_attn_weights=bool(attr(c, "scale_attn_weights", who, True)),
        scale_attn_by_inverse_layer_idx=bool(attr(c, "scale_attn_by_inverse_layer_idx", who, False)),
        bos_token_id=attr(c, "bos_token_id", who, None), eos_token_id=attr(c, "eos_token_id", who, None),
        use_alibi=alibi, use_flash_attn=alibi, tie_word_embeddings=bool(attr(c, "tie_word_embeddings", who, True)),
        mup_width_scale=float(attr(c, "mup_width_scale", who, 1.0)),
        mup_embeddings_multiplier=float(attr(c, "mup_embeddings_scale", who, 1.0)),
        mup_output_multiplier=float(attr(c, "mup_output_alpha", who, 1.0)),
        mup_scale_qk_dot_by_d=bool(attr(c, "mup_scale_qk_dot_by_d", who, False)), mlp_multiple_of=1, **scaling)


def _alibi_scaling(scaling) -> dict:
    """GPT2Config's ALiBi switches of BTLM's ``alibi_scaling`` (checked as BTLMConfig checks it):
    None → none; {"type": "linear", "factor": f} (a float > 1) → the slopes divided by f
    (alibi_slope_scale = 1 / f); {"type": "linear", "train_seq_len": n} (an int > 1) → divided by
    max(1, keys / n) at each call (alibi_train_seqlen = n)."""
    if scaling is None:
        return {}
    name = "btlm_config.alibi_scaling"
    if not isinstance(scaling, dict) or len(scaling) != 2 or scaling.get("type") != "linear":
        raise ValueError(f"{name} must be {{'type': 'linear', 'factor': float > 1}} or {{'type': 'linear', "
                         f"'train_seq_len': int > 1}}, got {scaling!r}")
    factor, train = scaling.get("factor"), scaling.get("train_seq_len")
    if factor is not None:
        if not isinstance(factor, float) or not factor > 1.0 or not math.isfinite(factor):
            raise ValueError(f"{name}['factor'] must be a float > 1.0, got {factor!r}")
        return dict(alibi_slope_scale=1.0 / factor)
    if not isinstance(train, int) or isinstance(train, bool) or train <= 1:
        raise ValueError(f"{name}['train_seq_len'] must be an int > 1, got {train!r}")
    return dict(alibi_train_seqlen=train)
