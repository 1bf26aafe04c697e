"""flash-attn 2.8's BERT (``flash_attn.models.bert``) on cuflash's modules: ``from
flash_attn.models.bert import BertForPreTraining`` becomes ``from cuflash.models.bert import
BertForPreTraining``, with the same config switches, module tree and state-dict keys
(``bert.embeddings.*``, ``bert.emb_ln``, ``bert.encoder.layers.{i}.mixer / norm1 / mlp / norm2``,
``bert.pooler.dense``, ``cls.predictions.transform / decoder``, ``cls.seq_relationship``).

* ``BertModel(config, add_pooling_layer=True)``: embeddings (word + position + token type) →
  LayerNorm → dropout → ``BertEncoder`` (post-norm ``Block``s, non-causal ``MHA``) → ``BertPooler``
  (tanh of a dense layer on the first token). ``forward(input_ids, position_ids=None,
  token_type_ids=None, attention_mask=None, masked_tokens_mask=None)`` returns
  ``BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state, pooler_output)``.
* ``BertForPreTraining(config)``: ``bert`` plus ``cls`` (``BertPreTrainingHeads``: the masked-LM
  head, its decoder tied to the word embedding, and the next-sentence head); ``forward(input_ids,
  position_ids=None, token_type_ids=None, attention_mask=None, labels=None,
  next_sentence_label=None)`` returns ``BertForPreTrainingOutput(loss, prediction_logits,
  seq_relationship_logits)``; the loss (labels and next_sentence_label given) is the masked-LM
  cross entropy (labels 0 ignored: label 0 marks an unmasked token) plus the next-sentence one
  (label -1 ignored), in fp32.
* The heads: ``BertPooler``, ``BertPredictionHeadTransform``, ``BertLMPredictionHead``,
  ``BertPreTrainingHeads``; ``BertEncoder``; the factories ``create_mixer_cls``,
  ``create_mlp_cls``, ``create_block``.
* ``remap_state_dict(state_dict, config)``: a Hugging Face ``BertForPreTraining`` state dict →
  this model's keys (q, k, v concatenated into ``Wqkv``; into ``Wq`` and ``Wkv`` for the last layer
  with ``last_layer_subset``; ``gamma`` / ``beta`` LayerNorm names of old checkpoints read too; the
  vocabulary padded to ``pad_vocab_size_multiple``, the padded decoder bias -100);
  ``inv_remap_state_dict``: the inverse.
* ``BertConfig``: a dataclass standing in for transformers' ``BertConfig`` (its attribute names
  and defaults, and flash-attn's switches with flash-attn's defaults; any other keyword becomes an
  attribute). Any object with BertConfig's attribute names works as config (transformers' own, a
  ``types.SimpleNamespace``): ``vocab_size``, ``hidden_size``, ``num_hidden_layers`` and
  ``num_attention_heads`` are required, the others take BertConfig's defaults when absent.

The unpadded path: with ``use_flash_attn`` and an ``attention_mask``, the encoder removes the
padding once (``cuflash.unpad_input``), every layer runs on the packed (total_tokens, hidden)
rows with cuflash's varlen attention (``cu_seqlens``), and the output is padded back with zeros
(``pad_input``): no compute on padding anywhere in the encoder. The offsets come from
``unpad_input``, so the layers' forward calls skip the varlen API's read-back check of
``cu_seqlens`` (``cuflash.api.trusted_cu_seqlens``; otherwise a host sync per layer). Without
``use_flash_attn`` the torch attention runs on the padded batch with the mask (flash-attn's
layout), so the hidden states at padded positions are whatever the layers make of them there;
compare kept positions.

``last_layer_subset`` (needs ``dense_seq_output``): ``BertForPreTraining`` computes the last layer
only for the masked tokens (labels > 0) and the first token of each row (the pooler's): its
mixer is a cross-attention (``Wq`` on those tokens, ``Wkv`` on all kept tokens).
``dense_seq_output``: the MLM head runs on the masked tokens only, and ``prediction_logits`` is
(masked tokens, vocab).

The config switches read: ``vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
intermediate_size, hidden_act`` (gelu; gelu_new / gelu_fast / gelu_pytorch_tanh: tanh GELU),
``hidden_dropout_prob, attention_probs_dropout_prob, max_position_embeddings, type_vocab_size,
initializer_range, layer_norm_eps, pad_token_id, position_embedding_type`` ("absolute", or
"rotary" with ``rotary_emb_dim, rotary_emb_base, rotary_emb_scale_base,
rotary_emb_interleaved``), ``use_flash_attn, fused_bias_fc, fused_mlp, mlp_checkpoint_lvl,
fused_dropout_add_ln, last_layer_subset, dense_seq_output, use_xentropy,
pad_vocab_size_multiple``. ``fused_bias_fc`` makes MHA's projections
``cuflash.ops.fused_dense.FusedDense`` (the same parameters); ``fused_mlp`` runs
``cuflash.modules.mlp.FusedMLP`` (``fused_mlp_func``, fused on CUDA fp16 / bf16); ``fused_dropout_add_ln`` runs
``cuflash.ops.layer_norm.layer_norm_fn``; ``use_xentropy`` runs
``cuflash.losses.cross_entropy.CrossEntropyLoss``.

Differences from flash-attn: the config is not modified (flash-attn rounds ``config.vocab_size``
up to ``pad_vocab_size_multiple`` in place; here the padded size is computed, and
``inv_remap_state_dict`` cuts back to ``config.orig_vocab_size`` if the config has it, else to
``config.vocab_size``); with ``position_embedding_type="rotary"`` the rotary dimension defaults
to head_dim (flash-attn's default, hidden_size, does not fit a head; as in flash-attn the learned
position embedding stays unless ``max_position_embeddings = 0``); ``from_pretrained`` reads a
local checkpoint, a given state dict or a hub model id (through the local Hugging Face cache,
downloading what it lacks: ``cuflash.utils.hub``), and ``BertModel.from_pretrained`` drops
the ``bert.`` prefix and the pretraining heads (flash-attn loads the prefixed keys with
strict=False, i.e. nothing); bad configs raise ``ValueError`` naming the attribute
(``config.hidden_act``, ...) before any module is made (flash-attn asserts).
"""
from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..api import UnsupportedFeature, trusted_cu_seqlens
from ..modules.block import Block
from ..modules.embedding import BertEmbeddings
from ..modules.mha import MHA
from ..modules.mlp import FusedMLP, Mlp
from ..ops.layer_norm import layer_norm_fn
from ..padding import index_first_axis, index_first_axis_residual, pad_input, unpad_input
from ._config import ConfigReader

__all__ = ["BertConfig", "BertPreTrainedModel", "BertModel", "BertForPreTraining", "BertEncoder", "BertPooler",
           "BertPredictionHeadTransform", "BertLMPredictionHead", "BertPreTrainingHeads",
           "BaseModelOutputWithPoolingAndCrossAttentions", "BertForPreTrainingOutput", "create_mixer_cls",
           "create_mlp_cls", "create_block", "remap_state_dict", "inv_remap_state_dict"]

logger = logging.getLogger(__name__)

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_TANH_GELU = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")
_ACTIVATIONS = ("gelu",) + _TANH_GELU


@dataclass(init=False)
class BertConfig:
    """transformers' ``BertConfig`` attribute names and defaults, without transformers, plus
    flash-attn's switches (with the defaults flash-attn assumes when a config lacks them). Any
    other keyword becomes an attribute too. A dataclass: ``fields``, ``asdict``, ``==`` and
    ``repr`` cover the fields below."""

    # BERT (transformers' BertConfig)
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: Optional[int] = 0
    position_embedding_type: str = "absolute"
    # flash-attn's switches
    use_flash_attn: bool = False
    fused_bias_fc: bool = False
    fused_mlp: bool = False
    mlp_checkpoint_lvl: Any = 0
    fused_dropout_add_ln: bool = False
    last_layer_subset: bool = False
    dense_seq_output: bool = False
    use_xentropy: bool = False
    pad_vocab_size_multiple: int = 1
    rotary_emb_dim: Optional[int] = None
    rotary_emb_base: float = 10000.0
    rotary_emb_scale_base: Optional[float] = None
    rotary_emb_interleaved: bool = False

    def __init__(self, **kwargs):
        for f in fields(self):
            setattr(self, f.name, f.default)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_pretrained(cls, model_name, revision="main", token=None, cache_dir=None, local_files_only=False,
                        **overrides):
        """transformers' ``BertConfig.from_pretrained``: the config.json of a local model
        directory or of a hub model id (downloaded into the Hugging Face cache when missing;
        ``cuflash.utils.hub``), ``overrides`` (e.g. ``use_flash_attn=True``) on top."""
        from ..utils.pretrained import config_from_pretrained

        values = vars(config_from_pretrained(model_name, revision=revision, token=token, cache_dir=cache_dir,
                                             local_files_only=local_files_only))
        values.pop("model_type", None)
        return cls(**{**values, **overrides})


_DEFAULTS = {f.name: f.default for f in fields(BertConfig)}


_CONFIG = ConfigReader("BertConfig", _DEFAULTS, _REQUIRED)
_get, _positive_int, _padded_vocab = _CONFIG.get, _CONFIG.positive_int, _CONFIG.padded_vocab


def _head_dim(config) -> int:
    hidden, heads = _positive_int(config, "hidden_size"), _positive_int(config, "num_attention_heads")
    if hidden % heads:
        raise ValueError(f"config.hidden_size = {hidden} must be divisible by config.num_attention_heads = {heads}")
    return hidden // heads


def _rotary_dim(config) -> int:
    """0 for absolute positions; the rotary dimension per head for "rotary"."""
    if _get(config, "position_embedding_type") != "rotary":
        return 0
    head_dim = _head_dim(config)
    dim = _get(config, "rotary_emb_dim")
    dim = head_dim if dim is None else dim
    if not isinstance(dim, int) or dim <= 0 or dim > head_dim or dim % 2:
        raise ValueError(f"config.rotary_emb_dim must be an even int in 2..head_dim ({head_dim}), got {dim!r}")
    return dim


def check_config(config) -> None:
    """The config's switches checked (ValueError naming the attribute), before any module is made."""
    _head_dim(config)
    _padded_vocab(config)
    _positive_int(config, "num_hidden_layers")
    _positive_int(config, "intermediate_size")
    act = _get(config, "hidden_act")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.hidden_act must be one of {list(_ACTIVATIONS)}, got {act!r}")
    if _get(config, "fused_mlp") and act not in _TANH_GELU:
        raise ValueError(f"config.fused_mlp needs an approximate (tanh) GELU: config.hidden_act in "
                         f"{list(_TANH_GELU)}, got {act!r}")
    kind = _get(config, "position_embedding_type")
    if kind not in ("absolute", "rotary"):
        raise UnsupportedFeature(f"config.position_embedding_type = {kind!r}: only 'absolute' and 'rotary' "
                                 "(as flash-attn)")
    _rotary_dim(config)
    for name in ("max_position_embeddings", "type_vocab_size"):
        value = _get(config, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"config.{name} must be an int >= 0, got {value!r}")
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        p = _get(config, name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"config.{name} must be in [0, 1), got {p!r}")
    if not _get(config, "layer_norm_eps") > 0:
        raise ValueError(f"config.layer_norm_eps must be > 0, got {_get(config, 'layer_norm_eps')!r}")
    if _get(config, "last_layer_subset") and not _get(config, "dense_seq_output"):
        raise ValueError("config.last_layer_subset needs config.dense_seq_output = True")
    if _get(config, "last_layer_subset") and kind == "rotary":
        raise UnsupportedFeature("config.last_layer_subset with rotary positions: the last layer's cross-attention "
                                 "has no rotary embedding (as in flash-attn)")


def create_mixer_cls(config, cross_attn=False, return_residual=False):
    """flash-attn's ``create_mixer_cls``: a ``partial`` of non-causal MHA with the config's heads,
    attention dropout, rotary (position_embedding_type "rotary") and use_flash_attn; fused_bias_fc:
    FusedDense projections (the same parameters)."""
    rotary_dim = _rotary_dim(config)
    rotary = (dict(rotary_emb_dim=rotary_dim, rotary_emb_base=_get(config, "rotary_emb_base"),
                   rotary_emb_scale_base=_get(config, "rotary_emb_scale_base"),
                   rotary_emb_interleaved=_get(config, "rotary_emb_interleaved")) if rotary_dim else {})
    return partial(MHA, num_heads=_get(config, "num_attention_heads"), cross_attn=cross_attn,
                   dropout=_get(config, "attention_probs_dropout_prob"), causal=False,
                   use_flash_attn=_get(config, "use_flash_attn"), return_residual=return_residual,
                   fused_bias_fc=bool(_get(config, "fused_bias_fc")), **rotary)


def create_mlp_cls(config, layer_idx=None, return_residual=False):
    """flash-attn's ``create_mlp_cls``: Mlp with GELU (tanh for gelu_new / gelu_fast /
    gelu_pytorch_tanh), or FusedMLP with fused_mlp; hidden size intermediate_size."""
    inner = _get(config, "intermediate_size")
    act = _get(config, "hidden_act")
    if not _get(config, "fused_mlp"):
        approximate = "tanh" if act in _TANH_GELU else "none"
        return partial(Mlp, hidden_features=inner, activation=partial(F.gelu, approximate=approximate),
                       return_residual=return_residual)
    lvl = _get(config, "mlp_checkpoint_lvl")
    if isinstance(lvl, Sequence):          # one level per layer
        if layer_idx is None:
            raise ValueError("config.mlp_checkpoint_lvl per layer needs layer_idx")
        lvl = lvl[layer_idx]
    return partial(FusedMLP, hidden_features=inner, checkpoint_lvl=lvl, return_residual=return_residual)


def create_block(config, layer_idx=None):
    """flash-attn's ``create_block``: a post-norm Block (mixer → dropout → add → LayerNorm → MLP →
    dropout → add → LayerNorm); the last layer with last_layer_subset has a cross-attention mixer
    and returns no residual."""
    cross_attn = bool(_get(config, "last_layer_subset")) and layer_idx == _get(config, "num_hidden_layers") - 1
    return_residual = not cross_attn
    p = _get(config, "hidden_dropout_prob")
    return Block(_get(config, "hidden_size"), create_mixer_cls(config, cross_attn, return_residual=return_residual),
                 create_mlp_cls(config, layer_idx, return_residual=return_residual),
                 norm_cls=partial(nn.LayerNorm, eps=_get(config, "layer_norm_eps")), prenorm=False,
                 resid_dropout1=p, resid_dropout2=p, fused_dropout_add_ln=_get(config, "fused_dropout_add_ln"),
                 return_residual=return_residual)


def _init_weights(module, initializer_range=0.02):
    """BERT's initialization: linear and embedding weights N(0, initializer_range²), linear biases
    zero, the embedding's padding row zero."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()


@dataclass
class BaseModelOutputWithPoolingAndCrossAttentions:
    """transformers' output of the same name (the fields BertModel fills, the rest None)."""
    last_hidden_state: Optional[torch.Tensor] = None
    pooler_output: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple] = None
    past_key_values: Optional[tuple] = None
    attentions: Optional[tuple] = None
    cross_attentions: Optional[tuple] = None


@dataclass
class BertForPreTrainingOutput:
    """transformers' output of the same name."""
    loss: Optional[torch.Tensor] = None
    prediction_logits: Optional[torch.Tensor] = None
    seq_relationship_logits: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None


def _subset_cu_seqlens(mask) -> torch.Tensor:
    return F.pad(torch.cumsum(mask.sum(dim=-1, dtype=torch.int32), dim=0, dtype=torch.int32), (1, 0))


class BertEncoder(nn.Module):
    """flash-attn's ``BertEncoder(config)``: ``layers``, num_hidden_layers post-norm blocks."""

    def __init__(self, config):
        super().__init__()
        self.use_flash_attn = _get(config, "use_flash_attn")
        self.layers = nn.ModuleList([create_block(config, layer_idx=i)
                                     for i in range(_get(config, "num_hidden_layers"))])

    def forward(self, hidden_states, key_padding_mask=None, subset_mask=None):
        """hidden_states: (batch, seqlen, hidden); key_padding_mask: bool (batch, seqlen), True
        keeps a token; subset_mask: bool (batch, seqlen), the tokens whose last-layer output is
        wanted (last_layer_subset). Returns (batch, seqlen, hidden) (zeros at the padding on the
        unpadded path), or with subset_mask the (subset tokens, hidden) rows in row-major order."""
        if key_padding_mask is None or not self.use_flash_attn:
            mixer_kwargs = {"key_padding_mask": key_padding_mask} if key_padding_mask is not None else None
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            if subset_mask is not None:
                keep = subset_mask if key_padding_mask is None else subset_mask & key_padding_mask
                hidden_states = hidden_states[keep]
            return hidden_states
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, max_seqlen, _ = unpad_input(hidden_states, key_padding_mask)
        # unpad_input's offsets are valid by construction: the layers' varlen calls need not
        # read them back (a host sync per layer)
        with trusted_cu_seqlens():
            return self._unpadded(hidden_states, key_padding_mask, subset_mask, indices, cu_seqlens, max_seqlen,
                                  batch, seqlen)

    def _unpadded(self, hidden_states, key_padding_mask, subset_mask, indices, cu_seqlens, max_seqlen, batch,
                  seqlen):
        mixer_kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        if subset_mask is None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return pad_input(hidden_states, indices, batch, seqlen)
        for layer in self.layers[:-1]:
            hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
        subset_idx = torch.nonzero(subset_mask[key_padding_mask], as_tuple=False).flatten()
        subset_cu = _subset_cu_seqlens(subset_mask & key_padding_mask)
        hidden_subset, hidden_states = index_first_axis_residual(hidden_states, subset_idx)
        # the subset's queries attend to all kept keys of their row; max_seqlen bounds both
        mixer_kwargs = {"x_kv": hidden_states, "cu_seqlens": subset_cu, "max_seqlen": max_seqlen,
                        "cu_seqlens_k": cu_seqlens, "max_seqlen_k": max_seqlen}
        return self.layers[-1](hidden_subset, mixer_kwargs=mixer_kwargs)


class BertPooler(nn.Module):
    """tanh(dense(the first token's hidden state)); ``forward(hidden_states, pool=False)`` takes
    the rows as they are."""

    def __init__(self, config):
        super().__init__()
        hidden = _get(config, "hidden_size")
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()

    def forward(self, hidden_states, pool=True):
        first = hidden_states[:, 0] if pool else hidden_states
        return self.activation(self.dense(first))


class BertPredictionHeadTransform(nn.Module):
    """dense → GELU → LayerNorm (``layer_norm``)."""

    def __init__(self, config):
        super().__init__()
        hidden = _get(config, "hidden_size")
        self.fused_dropout_add_ln = _get(config, "fused_dropout_add_ln")
        self.dense = nn.Linear(hidden, hidden)
        self.transform_act_fn = nn.GELU(approximate="tanh" if _get(config, "hidden_act") in _TANH_GELU else "none")
        self.layer_norm = nn.LayerNorm(hidden, eps=_get(config, "layer_norm_eps"))

    def forward(self, hidden_states):
        hidden_states = self.transform_act_fn(self.dense(hidden_states))
        if not self.fused_dropout_add_ln:
            return self.layer_norm(hidden_states)
        return layer_norm_fn(hidden_states, self.layer_norm.weight, self.layer_norm.bias, eps=self.layer_norm.eps)


class BertLMPredictionHead(nn.Module):
    """``transform``, then ``decoder`` (hidden → padded vocabulary, with bias; its weight tied to
    the word embedding by BertForPreTraining)."""

    def __init__(self, config):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(_get(config, "hidden_size"), _padded_vocab(config), bias=True)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertPreTrainingHeads(nn.Module):
    """``predictions`` (masked LM) and ``seq_relationship`` (next sentence, 2 classes)."""

    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(_get(config, "hidden_size"), 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class BertPreTrainedModel(nn.Module):
    """The config holder (checked: ValueError naming the attribute) and ``from_pretrained``."""

    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        check_config(config)
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name, config=None, *inputs, state_dict=None, strict=True, revision="main",
                        token=None, cache_dir=None, local_files_only=False, **kwargs):
        """flash-attn's ``from_pretrained(model_name, config, ...)``: the weights are
        ``state_dict`` if given, else read from ``model_name``: a local checkpoint file
        (``.safetensors``, read by cuflash's own reader, or a ``torch.save`` file, on the CPU), a
        local Hugging Face model directory (``model.safetensors``, ``pytorch_model.bin`` or their
        sharded indexes), or a Hugging Face hub model id (``"bert-base-uncased"``) resolved
        through the local Hugging Face cache and downloaded into it when missing
        (``cuflash.utils.hub``: ``revision``, ``token``, ``cache_dir``, ``local_files_only`` /
        ``HF_HUB_OFFLINE=1``). ``config`` defaults to the checkpoint's config.json (as a
        BertConfig). Hugging Face BERT keys (``bert.encoder.layer.``) are remapped; BertModel
        takes the ``bert.`` keys without the prefix and leaves the heads out."""
        hf_config = None
        if state_dict is None:
            from ._checkpoint import load_hf_config, load_state_dict_from, resolve_source
            path = resolve_source(model_name, "from_pretrained", revision=revision, token=token, cache_dir=cache_dir,
                                  local_files_only=local_files_only)
            if config is None and os.path.isdir(path):
                hf_config = load_hf_config(path)
            state_dict = load_state_dict_from(path)
        if config is None:
            if hf_config is None:
                raise ValueError(f"from_pretrained({model_name!r}): config is needed (no config.json to read)")
            config = BertConfig(**{k: v for k, v in vars(hf_config).items() if k != "model_type"})
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"state_dict must be a mapping of tensors, got {type(state_dict).__name__}")
        model = cls(config, *inputs, **kwargs)
        if any(re.match(r"^(bert\.)?encoder\.layer\.\d+\.", k) for k in state_dict):
            if not any(k.startswith("bert.") for k in state_dict):   # a BertModel checkpoint
                state_dict = OrderedDict(("bert." + k, v) for k, v in state_dict.items())
            state_dict = remap_state_dict(state_dict, config)
        if isinstance(model, BertModel):
            state_dict = OrderedDict((k[len("bert."):] if k.startswith("bert.") else k, v)
                                     for k, v in state_dict.items() if not k.startswith("cls."))
        logger.info(model.load_state_dict(state_dict, strict=strict))
        return model


class BertModel(BertPreTrainedModel):
    """flash-attn's ``BertModel(config, add_pooling_layer=True)``: ``embeddings``, ``emb_ln``,
    ``emb_drop``, ``encoder``, ``pooler`` (None without add_pooling_layer)."""

    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config)
        self.fused_dropout_add_ln = _get(config, "fused_dropout_add_ln")
        hidden = _get(config, "hidden_size")
        self.embeddings = BertEmbeddings(hidden, _padded_vocab(config), _get(config, "max_position_embeddings"),
                                         _get(config, "type_vocab_size"),
                                         padding_idx=_get(config, "pad_token_id"))
        self.emb_drop = nn.Dropout(_get(config, "hidden_dropout_prob"))
        self.emb_ln = nn.LayerNorm(hidden, eps=_get(config, "layer_norm_eps"))
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(partial(_init_weights, initializer_range=_get(config, "initializer_range")))

    def forward(self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None,
                masked_tokens_mask=None):
        """input_ids, token_type_ids: (batch, seqlen) int; attention_mask: (batch, seqlen), True /
        1 keeps a token (with use_flash_attn the padding is removed before the first layer);
        masked_tokens_mask: bool (batch, seqlen) (BertForPreTraining's last_layer_subset): the last
        layer runs only for these tokens and each row's first, last_hidden_state is then
        (masked tokens, hidden) in row-major order and the pooler reads the first tokens."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        batch, seqlen = input_ids.shape
        for name, mask in (("attention_mask", attention_mask), ("masked_tokens_mask", masked_tokens_mask)):
            if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, seqlen)):
                raise ValueError(f"{name} must be a (batch, seqlen) = {(batch, seqlen)} tensor, got "
                                 f"{tuple(getattr(mask, 'shape', ()))}")
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if masked_tokens_mask is not None and attention_mask is not None and not bool(attention_mask[:, 0].all()):
            raise ValueError("masked_tokens_mask: every row's first token (the pooler's) must be kept by "
                             "attention_mask")
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, token_type_ids=token_type_ids)
        # BERT: LayerNorm, then dropout
        if not self.fused_dropout_add_ln:
            hidden_states = self.emb_ln(hidden_states)
        else:
            hidden_states = layer_norm_fn(hidden_states, self.emb_ln.weight, self.emb_ln.bias, eps=self.emb_ln.eps)
        hidden_states = self.emb_drop(hidden_states)
        subset_mask = first_col = None
        if masked_tokens_mask is not None:
            first_col = torch.zeros(batch, seqlen, dtype=torch.bool, device=input_ids.device)
            first_col[:, 0] = True
            subset_mask = masked_tokens_mask.bool() | first_col
        sequence_output = self.encoder(hidden_states, key_padding_mask=attention_mask, subset_mask=subset_mask)
        if masked_tokens_mask is None:
            pooled = self.pooler(sequence_output) if self.pooler is not None else None
        else:
            kept = subset_mask if attention_mask is None else subset_mask & attention_mask
            pool_input = sequence_output[first_col[kept]]
            sequence_output = sequence_output[masked_tokens_mask.bool()[kept]]
            pooled = self.pooler(pool_input, pool=False) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=sequence_output, pooler_output=pooled)


class BertForPreTraining(BertPreTrainedModel):
    """flash-attn's ``BertForPreTraining(config)``: ``bert`` (BertModel), ``cls``
    (BertPreTrainingHeads), ``mlm_loss`` (ignore_index 0), ``nsp_loss`` (ignore_index -1)."""

    def __init__(self, config):
        super().__init__(config)
        self.dense_seq_output = _get(config, "dense_seq_output")
        self.last_layer_subset = _get(config, "last_layer_subset")
        if _get(config, "use_xentropy"):
            from ..losses.cross_entropy import CrossEntropyLoss
            loss_cls = partial(CrossEntropyLoss, inplace_backward=True)
        else:
            loss_cls = nn.CrossEntropyLoss
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.mlm_loss = loss_cls(ignore_index=0)
        self.nsp_loss = loss_cls(ignore_index=-1)
        self.apply(partial(_init_weights, initializer_range=_get(config, "initializer_range")))
        self.tie_weights()

    def tie_weights(self):
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None, labels=None,
                next_sentence_label=None):
        """labels: (batch, seqlen) int, the original token at masked positions and 0 elsewhere;
        next_sentence_label: (batch,) int (-1 ignored). prediction_logits: (batch, seqlen, vocab),
        or (masked tokens, vocab) with dense_seq_output and labels; seq_relationship_logits:
        (batch, 2); loss: with both labels."""
        if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape):
            raise ValueError(f"labels must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(getattr(labels, 'shape', ()))}")
        if (self.dense_seq_output and labels is not None and attention_mask is not None
                and bool(((labels > 0) & ~attention_mask.bool()).any())):
            raise ValueError("labels: a masked token (label > 0) at a position attention_mask drops; with "
                             "dense_seq_output the labels must be 0 at the padding")
        masked_tokens_mask = labels > 0 if (self.last_layer_subset and labels is not None) else None
        outputs = self.bert(input_ids, position_ids=position_ids, token_type_ids=token_type_ids,
                            attention_mask=attention_mask.bool() if attention_mask is not None else None,
                            masked_tokens_mask=masked_tokens_mask)
        sequence_output, pooled_output = outputs.last_hidden_state, outputs.pooler_output
        masked_idx = None
        if self.dense_seq_output and labels is not None:
            masked_idx = torch.nonzero(labels.flatten() > 0, as_tuple=False).flatten()
            if not self.last_layer_subset:
                sequence_output = index_first_axis(sequence_output.flatten(0, 1), masked_idx)
        prediction_scores, seq_relationship_score = self.cls(sequence_output, pooled_output)
        total_loss = None
        if labels is not None and next_sentence_label is not None:
            if masked_idx is not None:          # the scores are the masked tokens' already
                mlm = self.mlm_loss(prediction_scores, labels.flatten()[masked_idx])
            else:
                mlm = self.mlm_loss(prediction_scores.flatten(0, -2), labels.flatten())
            nsp = self.nsp_loss(seq_relationship_score.flatten(0, -2), next_sentence_label.flatten())
            total_loss = mlm.float() + nsp.float()
        return BertForPreTrainingOutput(loss=total_loss, prediction_logits=prediction_scores,
                                        seq_relationship_logits=seq_relationship_score)


# ---------------------------------------------------------------------------------------
# checkpoints

_LAYER_NAMES = [  # (Hugging Face, this model) below bert.encoder.layer(s).{i}.
    ("attention.output.LayerNorm.", "norm1."), ("output.LayerNorm.", "norm2."),
    ("intermediate.dense.", "mlp.fc1."), ("output.dense.", "mlp.fc2."),
    ("attention.output.dense.", "mixer.out_proj.")]
_TOP_NAMES = [("bert.embeddings.LayerNorm.", "bert.emb_ln."),
              ("cls.predictions.transform.LayerNorm.", "cls.predictions.transform.layer_norm.")]


def _n_layers(config) -> int:
    return _positive_int(config, "num_hidden_layers")


def remap_state_dict(state_dict, config):
    """A Hugging Face ``BertForPreTraining`` state dict (``bert.embeddings.*``,
    ``bert.encoder.layer.{i}.attention.self.query / key / value``, ``attention.output.dense /
    LayerNorm``, ``intermediate.dense``, ``output.dense / LayerNorm``, ``bert.pooler.dense``,
    ``cls.predictions.bias / transform.* / decoder.weight``, ``cls.seq_relationship.*``; old
    ``gamma`` / ``beta`` LayerNorm names too) → this model's keys. The word embedding and the
    decoder are padded up to pad_vocab_size_multiple (zero rows; the decoder bias -100 there);
    ``bert.embeddings.position_ids`` (a buffer of some transformers versions) is dropped. Returns
    a new OrderedDict."""
    n_layer = _n_layers(config)
    subset = bool(_get(config, "last_layer_subset"))
    sd = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
        key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
        if key == "bert.embeddings.position_ids":
            continue
        for old, new in _TOP_NAMES:
            if key.startswith(old):
                key = new + key[len(old):]
        m = re.match(r"^bert\.encoder\.layer\.(\d+)\.(.*)$", key)
        if m:
            rest = m.group(2)
            for old, new in _LAYER_NAMES:
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            key = f"bert.encoder.layers.{m.group(1)}.{rest}"
        if key == "cls.predictions.bias":
            key = "cls.predictions.decoder.bias"
        sd[key] = value
    for i in range(n_layer):
        p = f"bert.encoder.layers.{i}."
        try:
            q, k, v = (sd.pop(f"{p}attention.self.{n}.weight") for n in ("query", "key", "value"))
            bq, bk, bv = (sd.pop(f"{p}attention.self.{n}.bias") for n in ("query", "key", "value"))
        except KeyError as e:
            raise ValueError(f"remap_state_dict: the BERT state dict lacks {e.args[0]!r} (config.num_hidden_layers "
                             f"= {n_layer})") from None
        if subset and i == n_layer - 1:
            sd[p + "mixer.Wq.weight"], sd[p + "mixer.Wq.bias"] = q, bq
            sd[p + "mixer.Wkv.weight"], sd[p + "mixer.Wkv.bias"] = torch.cat([k, v]), torch.cat([bk, bv])
        else:
            sd[p + "mixer.Wqkv.weight"], sd[p + "mixer.Wqkv.bias"] = torch.cat([q, k, v]), torch.cat([bq, bk, bv])
    word = "bert.embeddings.word_embeddings.weight"
    if "cls.predictions.decoder.weight" not in sd and word in sd and "cls.predictions.decoder.bias" in sd:
        sd["cls.predictions.decoder.weight"] = sd[word]       # tied (some checkpoints leave it out)
    vocab = _padded_vocab(config)
    for key in (word, "cls.predictions.decoder.weight"):
        if key in sd:
            if sd[key].shape[0] > vocab:
                raise ValueError(f"remap_state_dict: {key} has {sd[key].shape[0]} rows, more than the padded "
                                 f"vocabulary ({vocab})")
            sd[key] = F.pad(sd[key], (0, 0, 0, vocab - sd[key].shape[0]))
    key = "cls.predictions.decoder.bias"
    if key in sd:
        sd[key] = F.pad(sd[key], (0, vocab - sd[key].shape[0]), value=-100.0)
    return sd


def inv_remap_state_dict(state_dict, config):
    """This model's state dict → Hugging Face BERT's keys (the inverse of remap_state_dict): Wqkv
    (or Wq / Wkv) split into query / key / value, the vocabulary cut back to
    ``config.orig_vocab_size`` (flash-attn's attribute) or else ``config.vocab_size``, the decoder
    bias as ``cls.predictions.bias``. Returns a new OrderedDict."""
    n_layer = _n_layers(config)
    vocab = _get(config, "orig_vocab_size", None) or _get(config, "vocab_size")
    sd = OrderedDict()
    for key, value in state_dict.items():
        if key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
                   "cls.predictions.decoder.bias"):
            value = value[:vocab]
        if key == "cls.predictions.decoder.bias":
            key = "cls.predictions.bias"
        m = re.match(r"^bert\.encoder\.layers\.(\d+)\.(.*)$", key)
        if m:
            layer, rest = m.groups()
            p = f"bert.encoder.layer.{layer}."
            mm = re.match(r"^mixer\.(Wqkv|Wq|Wkv)\.(weight|bias)$", rest)
            if mm:
                names = {"Wqkv": ("query", "key", "value"), "Wq": ("query",), "Wkv": ("key", "value")}[mm.group(1)]
                for name, part in zip(names, value.chunk(len(names), dim=0)):
                    sd[f"{p}attention.self.{name}.{mm.group(2)}"] = part
                continue
            for old, new in _LAYER_NAMES:
                if rest.startswith(new):
                    rest = old + rest[len(new):]
                    break
            key = p + rest
        for old, new in _TOP_NAMES:
            if key.startswith(new):
                key = old + key[len(new):]
        sd[key] = value
    if len([k for k in sd if re.match(r"^bert\.encoder\.layer\.\d+\.attention\.self\.query\.weight$", k)]) != n_layer:
        raise ValueError(f"inv_remap_state_dict: the state dict does not hold config.num_hidden_layers = {n_layer} "
                         "attention layers")
    return sd
