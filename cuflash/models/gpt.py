"""flash-attn 2.8's GPT model family (``flash_attn.models.gpt``) on cuflash's modules: ``from
flash_attn.models.gpt import GPTLMHeadModel`` becomes ``from cuflash.models.gpt import
GPTLMHeadModel``, with the same config switches, module tree and state-dict keys
(``transformer.embeddings.*``, ``transformer.layers.{i}.mixer / norm1 / mlp / norm2``,
``transformer.ln_f``, ``lm_head``), so flash-attn checkpoints load as they are.

* ``GPTModel(config, process_group=None, device=None, dtype=None)``: embeddings
  (``GPT2Embeddings``, or ``ParallelGPT2Embeddings`` over a process group), ``n_layer`` blocks made
  by ``create_block`` and the final dropout → add → norm; ``forward(input_ids, position_ids=None,
  inference_params=None)`` returns the hidden states.
* ``GPTLMHeadModel``: ``GPTModel`` plus ``lm_head`` (tied to the word embedding with
  ``tie_word_embeddings``, the default); ``forward(input_ids, position_ids=None,
  inference_params=None, num_last_tokens=0)`` returns ``CausalLMOutput(logits=...)`` (the last
  ``num_last_tokens`` positions only when > 0); ``generate`` from
  ``cuflash.utils.generation.GenerationMixin`` (greedy / top-k / top-p / min-p, KV cache through
  ``inference_params``, decoding steps on ``flash_attn_with_kvcache`` with ``use_flash_attn``).
* ``create_mixer_cls``, ``create_mlp_cls``, ``create_block``: the per-layer factories;
  ``remap_state_dict_hf_gpt2``: a Hugging Face GPT-2 state dict → this model's keys;
  ``shard_state_dict_tp`` / ``combine_state_dicts_tp``: a model's state dict ↔ one rank's.
* ``GPT2Config``: a dataclass standing in for transformers' ``GPT2Config`` (its attribute names
  and defaults, and flash-attn's switches as fields with flash-attn's defaults; ``hidden_size`` /
  ``num_attention_heads`` / ``num_hidden_layers`` / ``max_position_embeddings`` read as ``n_embd`` /
  ``n_head`` / ``n_layer`` / ``n_positions``; any other keyword becomes an attribute). Any object
  with those attribute names works as config
  (transformers' own ``GPT2Config``, a ``types.SimpleNamespace``): ``vocab_size``, ``n_embd``,
  ``n_head`` and ``n_layer`` are required, the other GPT2Config attributes take GPT2Config's
  defaults when absent, flash-attn's extra switches theirs.

The config switches read: ``n_embd, n_head, n_layer, n_inner, n_positions, vocab_size,
layer_norm_epsilon, initializer_range, resid_pdrop, embd_pdrop, attn_pdrop, activation_function``
(gelu, gelu_new / gelu_fast / gelu_approx (tanh GELU), relu, sqrelu, glu, swiglu, geglu),
``scale_attn_weights, scale_attn_by_inverse_layer_idx, rotary_emb_fraction, rotary_emb_base,
rotary_emb_scale_base, rotary_emb_interleaved, n_head_kv`` (MQA / GQA), ``use_flash_attn``
(cuflash's kernels; else the torch attention), ``fused_bias_fc, fused_mlp,
fused_dense_sqrelu_dense, mlp_checkpoint_lvl, fused_dropout_add_ln, residual_in_fp32, rms_norm,
prenorm, parallel_block, parallel_block_tied_norm, tie_word_embeddings, lm_head_bias,
pad_vocab_size_multiple, mlp_fc1_bias, mlp_fc2_bias, qkv_proj_bias, out_proj_bias,
word_embed_proj_dim, attn_dwconv, sequence_parallel``, and flash-attn 2.8's later switches
``use_alibi`` (ALiBi slopes ``get_alibi_slopes(n_head)``; needs ``use_flash_attn``),
``window_size`` (sliding window; needs ``use_flash_attn``), ``mlp_multiple_of`` (the gated MLP's
hidden size rounded up to it, default 128), ``norm_head`` (Baichuan 2: the lm_head rows
unit-normalized in the forward), and muP's (BTLM) ``mup_width_scale`` (init std times its square
root; the lm_head input times it), ``mup_embeddings_multiplier`` (the embeddings' output times it),
``mup_output_multiplier`` (the lm_head input times it), ``mup_attn_multiplier`` (the softmax scale
times it), ``mup_scale_qk_dot_by_d`` (softmax scale 1 / head_dim instead of 1 / sqrt(head_dim)).
cuflash's own ALiBi switches (with ``use_alibi``; MHA's arguments of the same names):
``alibi_slope_scale`` (the slopes times it: Falcon-RW's 1 / sqrt(head_dim), BTLM's 1 / factor) and
``alibi_train_seqlen`` (BTLM's dynamic position interpolation: the slopes divided by max(1, keys /
alibi_train_seqlen)).

The fused switches keep the parameters and keys: ``fused_bias_fc`` → MHA's projections are
``cuflash.ops.fused_dense.FusedDense`` (the tensor-parallel model's stay Column/RowParallelLinear);
``fused_mlp`` / ``fused_dense_sqrelu_dense`` → ``cuflash.modules.mlp.FusedMLP`` (``fused_mlp_func``:
on CUDA fp16 / bf16 the bias / activation in fc1's cuBLASLt epilogue and ``kernels_cu/dense_act.cu``,
``mlp_checkpoint_lvl`` as flash-attn's); ``fused_dropout_add_ln`` →
``cuflash.ops.layer_norm.layer_norm_fn`` (fused CUDA kernels without dropout, else a torch
composition).

Differences from flash-attn (on the accepting side): the tensor-parallel model
(``process_group``) does not need ``fused_bias_fc``; ``GPTPreTrainedModel`` takes any config object
with GPT2Config's attribute names; ``from_pretrained`` reads a local checkpoint file, a local
Hugging Face model directory (config.json converted by its family's helper; safetensors read by
cuflash's own reader; sharded indexes) or a given state dict, and remaps every family of
cuflash.models; a Hugging Face hub model id (``"gpt2"``, ``"org/name"``) is read from the local
Hugging Face cache, downloaded into it when missing (``cuflash.utils.hub``). Bad configs raise
``ValueError`` naming the attribute (``config.n_head``, ...) before any parameter is made;
``attn_dwconv`` and a ``head_dim`` other than ``n_embd / n_head`` raise
``cuflash.UnsupportedFeature``.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict, namedtuple
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..api import UnsupportedFeature
from ..modules.block import Block, ParallelBlock
from ..modules.embedding import GPT2Embeddings, ParallelGPT2Embeddings
from ..modules.mha import MHA, ParallelMHA
from ..modules.mlp import FusedMLP, GatedMlp, Mlp, ParallelFusedMLP, ParallelGatedMlp, ParallelMLP
from ..ops.activations import sqrelu_fwd
from ..ops.fused_dense import ColumnParallelLinear
from ..ops.layer_norm import RMSNorm, layer_norm_fn
from ..utils.distributed import all_gather, all_gather_raw, local_range, sync_shared_params
from ..utils.generation import GenerationMixin
from ._config import ConfigReader

__all__ = ["GPT2Config", "GPTPreTrainedModel", "GPTModel", "GPTLMHeadModel", "CausalLMOutput", "create_mixer_cls",
           "create_mlp_cls", "create_block", "remap_state_dict_hf_gpt2", "shard_state_dict_tp",
           "combine_state_dicts_tp"]

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])

# GPT2Config's attribute_map: the generic names transformers' configs answer to
_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
            "max_position_embeddings": "n_positions"}
_GPT2_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                      activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                      layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
                      scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, bos_token_id=50256,
                      eos_token_id=50256, tie_word_embeddings=True)
_REQUIRED = ("vocab_size", "n_embd", "n_head", "n_layer")
_GATED = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}
_TANH_GELU = ("gelu_new", "gelu_fast", "gelu_approx", "gelu_pytorch_tanh")
_ACTIVATIONS = ("gelu",) + _TANH_GELU + ("relu", "sqrelu") + tuple(_GATED)


@dataclass(init=False)
class GPT2Config:
    """transformers' ``GPT2Config`` attribute names and defaults, without transformers, plus
    flash-attn's switches (with the defaults flash-attn assumes when a config lacks them):
    ``GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, ..., use_flash_attn=False,
    ...)``. Keywords may also use the generic aliases ``hidden_size``, ``num_attention_heads``,
    ``num_hidden_layers``, ``max_position_embeddings`` (read and written as ``n_embd``, ``n_head``,
    ``n_layer``, ``n_positions``); any other keyword becomes an attribute too, as in
    transformers. A dataclass: ``dataclasses.fields``, ``asdict``, ``==`` and ``repr`` cover the
    fields below."""

    # GPT-2 (transformers' GPT2Config)
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    bos_token_id: Optional[int] = 50256
    eos_token_id: Optional[int] = 50256
    pad_token_id: Optional[int] = None
    tie_word_embeddings: bool = True
    # flash-attn's switches
    n_head_kv: Optional[int] = None
    rotary_emb_fraction: float = 0.0
    rotary_emb_base: float = 10000.0
    rotary_emb_scale_base: Optional[float] = None
    rotary_emb_interleaved: bool = False
    use_flash_attn: bool = False
    fused_bias_fc: bool = False
    fused_mlp: bool = False
    fused_dense_sqrelu_dense: bool = False
    mlp_checkpoint_lvl: Any = 0
    fused_dropout_add_ln: bool = False
    residual_in_fp32: bool = False
    rms_norm: bool = False
    prenorm: bool = True
    parallel_block: bool = False
    parallel_block_tied_norm: bool = False
    pad_vocab_size_multiple: int = 1
    mlp_fc1_bias: bool = True
    mlp_fc2_bias: bool = True
    qkv_proj_bias: bool = True
    out_proj_bias: bool = True
    lm_head_bias: bool = False
    word_embed_proj_dim: Optional[int] = None
    sequence_parallel: bool = True
    use_alibi: bool = False
    window_size: Any = (-1, -1)
    mlp_multiple_of: int = 128
    norm_head: bool = False
    mup_width_scale: float = 1.0
    mup_embeddings_multiplier: float = 1.0
    mup_output_multiplier: float = 1.0
    mup_attn_multiplier: float = 1.0
    mup_scale_qk_dot_by_d: bool = False
    # cuflash's (Falcon-RW's and BTLM's ALiBi variants; see MHA)
    alibi_slope_scale: float = 1.0
    alibi_train_seqlen: Optional[int] = None

    model_type: ClassVar[str] = "gpt2"
    attribute_map: ClassVar[dict] = dict(_ALIASES)

    def __init__(self, **kwargs):
        for f in fields(self):
            setattr(self, f.name, f.default)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __setattr__(self, name, value):
        super().__setattr__(_ALIASES.get(name, name), value)

    def __getattr__(self, name):     # only for names not set: the aliases
        if name in _ALIASES:
            return getattr(self, _ALIASES[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def to_dict(self) -> dict:
        """Every attribute, the fields and any extra keyword."""
        return dict(vars(self))

    @classmethod
    def from_pretrained(cls, model_name, revision="main", token=None, cache_dir=None, local_files_only=False,
                        **overrides):
        """transformers' ``GPT2Config.from_pretrained``: the config.json of a local model
        directory or of a hub model id (downloaded into the Hugging Face cache when missing;
        ``cuflash.utils.hub``), ``overrides`` on top. A config.json of another family raises
        ValueError (convert it: ``<family>_config_to_gpt2_config(config_from_pretrained(name))``,
        ``cuflash.utils.pretrained``)."""
        from ..utils.pretrained import config_from_pretrained

        values = vars(config_from_pretrained(model_name, revision=revision, token=token, cache_dir=cache_dir,
                                             local_files_only=local_files_only))
        kind = values.pop("model_type", "gpt2")
        if kind != "gpt2":
            raise ValueError(f"GPT2Config.from_pretrained({model_name!r}): config.json's model_type is {kind!r}, not "
                             f"'gpt2'; convert it with cuflash.models.<family>'s <family>_config_to_gpt2_config")
        return cls(**{**values, **overrides})


_CONFIG = ConfigReader("GPT2Config", _GPT2_DEFAULTS, _REQUIRED, _ALIASES)
_get, _positive_int, _padded_vocab = _CONFIG.get, _CONFIG.positive_int, _CONFIG.padded_vocab


def _head_dim(config) -> int:
    n_embd, n_head = _positive_int(config, "n_embd"), _positive_int(config, "n_head")
    if n_embd % n_head:
        raise ValueError(f"config.n_embd = {n_embd} must be divisible by config.n_head = {n_head}")
    head_dim = _get(config, "head_dim", None)
    if head_dim is not None and head_dim != n_embd // n_head:
        raise UnsupportedFeature(f"config.head_dim = {head_dim} differs from n_embd / n_head = {n_embd // n_head}: "
                                 "cuflash's MHA has head_dim = n_embd / n_head")
    return n_embd // n_head


def check_config(config) -> None:
    """The config's switches checked (ValueError naming the attribute), before any module is made."""
    head_dim = _head_dim(config)
    n_head = _get(config, "n_head")
    _positive_int(config, "n_layer")
    _padded_vocab(config)
    n_head_kv = _get(config, "n_head_kv", None)
    if n_head_kv is not None and (not isinstance(n_head_kv, int) or n_head_kv <= 0 or n_head % n_head_kv):
        raise ValueError(f"config.n_head_kv = {n_head_kv!r} must be a positive divisor of config.n_head = {n_head}")
    act = _get(config, "activation_function")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.activation_function must be one of {list(_ACTIVATIONS)}, got {act!r}")
    fraction = _get(config, "rotary_emb_fraction", 0.0)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"config.rotary_emb_fraction must be in [0, 1], got {fraction!r}")
    if int(fraction * head_dim) % 2:
        raise ValueError(f"config.rotary_emb_fraction = {fraction} gives an odd rotary dimension "
                         f"{int(fraction * head_dim)} of head_dim {head_dim}; rotary rotates pairs")
    positions = _get(config, "n_positions")
    if not isinstance(positions, int) or positions < 0:
        raise ValueError(f"config.n_positions must be an int >= 0 (0: no position embedding), got {positions!r}")
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        p = _get(config, name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"config.{name} must be in [0, 1), got {p!r}")
    eps = _get(config, "layer_norm_epsilon")
    if not eps > 0:
        raise ValueError(f"config.layer_norm_epsilon must be > 0, got {eps!r}")
    fused_mlp = _get(config, "fused_mlp", False)
    sqrelu_dense = _get(config, "fused_dense_sqrelu_dense", False)
    if fused_mlp and act not in _TANH_GELU + ("relu", "sqrelu"):
        raise ValueError(f"config.fused_mlp needs activation_function in {list(_TANH_GELU + ('relu', 'sqrelu'))}, "
                         f"got {act!r}")
    if sqrelu_dense and act != "sqrelu":
        raise ValueError(f"config.fused_dense_sqrelu_dense needs activation_function 'sqrelu', got {act!r}")
    if sqrelu_dense and fused_mlp:
        raise ValueError("config.fused_dense_sqrelu_dense and config.fused_mlp exclude each other")
    prenorm = _get(config, "prenorm", True)
    if _get(config, "parallel_block", False) and not prenorm:
        raise ValueError("config.parallel_block needs config.prenorm = True")
    if _get(config, "residual_in_fp32", False) and not prenorm:
        raise ValueError("config.residual_in_fp32 needs config.prenorm = True")
    if _get(config, "attn_dwconv", False):
        raise UnsupportedFeature("config.attn_dwconv: the depthwise convolution after the projections is not part "
                                 "of cuflash's MHA")
    use_flash = _get(config, "use_flash_attn", False)
    use_alibi = _get(config, "use_alibi", False)
    if use_alibi and not use_flash:
        raise ValueError("config.use_alibi needs config.use_flash_attn = True (the torch attention has no ALiBi)")
    slope_scale = _get(config, "alibi_slope_scale", 1.0)
    if (not isinstance(slope_scale, (int, float)) or isinstance(slope_scale, bool) or not slope_scale > 0
            or not math.isfinite(slope_scale)):
        raise ValueError(f"config.alibi_slope_scale must be a finite number > 0, got {slope_scale!r}")
    train_seqlen = _get(config, "alibi_train_seqlen", None)
    if train_seqlen is not None and (not isinstance(train_seqlen, int) or isinstance(train_seqlen, bool)
                                     or train_seqlen < 1):
        raise ValueError(f"config.alibi_train_seqlen must be None or an int >= 1, got {train_seqlen!r}")
    if not use_alibi and (slope_scale != 1.0 or train_seqlen is not None):
        raise ValueError("config.alibi_slope_scale and config.alibi_train_seqlen need config.use_alibi = True")
    window = _get(config, "window_size", (-1, -1))
    if (not isinstance(window, Sequence) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"config.window_size must be (left, right) ints >= -1, got {window!r}")
    if tuple(window) != (-1, -1) and not use_flash:
        raise ValueError("config.window_size needs config.use_flash_attn = True (the torch attention has no window)")
    multiple = _get(config, "mlp_multiple_of", 128)
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ValueError(f"config.mlp_multiple_of must be an int >= 1, got {multiple!r}")
    for name in ("mup_width_scale", "mup_embeddings_multiplier", "mup_output_multiplier", "mup_attn_multiplier"):
        value = _get(config, name, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"config.{name} must be a number > 0, got {value!r}")


def create_mixer_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    """flash-attn's ``create_mixer_cls``: a ``partial`` of MHA (ParallelMHA with process_group),
    causal, with the config's heads, biases, dropout, softmax scale (1 / sqrt(head_dim) with
    scale_attn_weights, divided by layer_idx + 1 with scale_attn_by_inverse_layer_idx), rotary
    (rotary_emb_fraction · head_dim features) and use_flash_attn. fused_bias_fc: MHA's
    projections are FusedDense (see the module docstring)."""
    factory = dict(device=device, dtype=dtype)
    head_dim = _head_dim(config)
    # muP (BTLM): 1 / head_dim instead of 1 / sqrt(head_dim), times mup_attn_multiplier
    power = 1.0 if _get(config, "mup_scale_qk_dot_by_d", False) else 0.5
    softmax_scale = head_dim ** -power if _get(config, "scale_attn_weights") else 1.0
    softmax_scale *= _get(config, "mup_attn_multiplier", 1.0)
    if _get(config, "scale_attn_by_inverse_layer_idx"):
        if layer_idx is None:
            raise ValueError("config.scale_attn_by_inverse_layer_idx needs layer_idx")
        softmax_scale /= float(layer_idx + 1)
    if _get(config, "attn_dwconv", False):
        raise UnsupportedFeature("config.attn_dwconv: the depthwise convolution after the projections is not part "
                                 "of cuflash's MHA")
    common = dict(num_heads=_get(config, "n_head"), num_heads_kv=_get(config, "n_head_kv", None),
                  qkv_proj_bias=_get(config, "qkv_proj_bias", True), out_proj_bias=_get(config, "out_proj_bias", True),
                  dropout=_get(config, "attn_pdrop"), softmax_scale=softmax_scale, causal=True, layer_idx=layer_idx,
                  rotary_emb_dim=int(_get(config, "rotary_emb_fraction", 0.0) * head_dim),
                  rotary_emb_base=_get(config, "rotary_emb_base", 10000.0),
                  rotary_emb_scale_base=_get(config, "rotary_emb_scale_base", None),
                  rotary_emb_interleaved=_get(config, "rotary_emb_interleaved", False),
                  use_alibi=_get(config, "use_alibi", False), window_size=tuple(_get(config, "window_size", (-1, -1))),
                  use_flash_attn=_get(config, "use_flash_attn", False), **factory,
                  alibi_slope_scale=_get(config, "alibi_slope_scale", 1.0),
                  alibi_train_seqlen=_get(config, "alibi_train_seqlen", None))
    if process_group is None:
        return partial(MHA, fused_bias_fc=_get(config, "fused_bias_fc", False), **common)
    return partial(ParallelMHA, process_group=process_group,
                   sequence_parallel=_get(config, "sequence_parallel", True), **common)


def _mlp_checkpoint_lvl(config, layer_idx) -> int:
    lvl = _get(config, "mlp_checkpoint_lvl", 0)
    if isinstance(lvl, Sequence):    # one level per layer
        if layer_idx is None:
            raise ValueError("config.mlp_checkpoint_lvl per layer needs layer_idx")
        lvl = lvl[layer_idx]
    return lvl


def create_mlp_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    """flash-attn's ``create_mlp_cls``: glu / swiglu / geglu → GatedMlp (ParallelGatedMlp);
    fused_mlp / fused_dense_sqrelu_dense → FusedMLP (ParallelFusedMLP) with the activation's name;
    otherwise Mlp (ParallelMLP) with the activation (tanh GELU for gelu_new / gelu_fast /
    gelu_approx). Hidden size n_inner (default 4 · n_embd; GatedMlp's own default when gated)."""
    factory = dict(device=device, dtype=dtype)
    act = _get(config, "activation_function")
    n_inner = _get(config, "n_inner")
    biases = dict(bias1=_get(config, "mlp_fc1_bias", True), bias2=_get(config, "mlp_fc2_bias", True))
    parallel = ({} if process_group is None else
                dict(process_group=process_group, sequence_parallel=_get(config, "sequence_parallel", True)))
    fused_mlp = _get(config, "fused_mlp", False)
    sqrelu_dense = _get(config, "fused_dense_sqrelu_dense", False)
    if fused_mlp or sqrelu_dense:
        hidden = n_inner if n_inner is not None else 4 * _get(config, "n_embd")
        name = "gelu_approx" if act in _TANH_GELU else act
        if sqrelu_dense:   # flash-attn's FusedDenseSqreluDense: fc1 → relu² → fc2, biases on
            if process_group is not None:
                raise ValueError("config.fused_dense_sqrelu_dense has no tensor-parallel form (process_group)")
            biases = dict(bias1=True, bias2=True)
        cls = FusedMLP if process_group is None else ParallelFusedMLP
        return partial(cls, hidden_features=hidden, activation=name,
                       checkpoint_lvl=_mlp_checkpoint_lvl(config, layer_idx), **biases, **parallel, **factory)
    if act in _GATED:
        cls = GatedMlp if process_group is None else ParallelGatedMlp
        return partial(cls, hidden_features=n_inner, activation=_GATED[act],
                       multiple_of=_get(config, "mlp_multiple_of", 128), **biases, **parallel, **factory)
    if act == "relu":
        activation = F.relu
    elif act == "sqrelu":
        activation = sqrelu_fwd
    else:
        activation = partial(F.gelu, approximate="tanh" if act in _TANH_GELU else "none")
    hidden = n_inner if n_inner is not None else 4 * _get(config, "n_embd")
    cls = Mlp if process_group is None else ParallelMLP
    return partial(cls, hidden_features=hidden, activation=activation, **biases, **parallel, **factory)


def create_block(config, layer_idx=None, process_group=None, device=None, dtype=None):
    """flash-attn's ``create_block``: a Block (ParallelBlock with parallel_block) of the config's
    mixer and MLP, nn.LayerNorm or RMSNorm (rms_norm) with layer_norm_epsilon, resid_dropout1 =
    embd_pdrop in layer 0 (the embeddings' dropout: dropout → add → norm order) and resid_pdrop
    after; block.layer_idx set."""
    factory = dict(device=device, dtype=dtype)
    mixer_cls = create_mixer_cls(config, layer_idx, process_group=process_group, **factory)
    mlp_cls = create_mlp_cls(config, layer_idx, process_group=process_group, **factory)
    norm_cls = partial(RMSNorm if _get(config, "rms_norm", False) else nn.LayerNorm,
                       eps=_get(config, "layer_norm_epsilon"), **factory)
    resid_dropout1 = _get(config, "embd_pdrop") if layer_idx == 0 else _get(config, "resid_pdrop")
    sequence_parallel = _get(config, "sequence_parallel", True) and process_group is not None
    common = dict(norm_cls=norm_cls, resid_dropout1=resid_dropout1, resid_dropout2=_get(config, "resid_pdrop"),
                  fused_dropout_add_ln=_get(config, "fused_dropout_add_ln", False),
                  residual_in_fp32=_get(config, "residual_in_fp32", False), sequence_parallel=sequence_parallel,
                  mark_shared_params=process_group is not None)
    if _get(config, "parallel_block", False):
        if not _get(config, "prenorm", True):
            raise ValueError("config.parallel_block needs config.prenorm = True")
        block = ParallelBlock(_get(config, "n_embd"), mixer_cls, mlp_cls,
                              tied_norm=_get(config, "parallel_block_tied_norm", False), **common)
    else:
        block = Block(_get(config, "n_embd"), mixer_cls, mlp_cls, prenorm=_get(config, "prenorm", True), **common)
    block.layer_idx = layer_idx
    return block


def _init_weights(module, n_layer, initializer_range=0.02, mup_width_scale=1.0, rescale_prenorm_residual=True):
    """GPT-2's initialization: linear and embedding weights N(0, initializer_range²), linear
    biases zero; the residual branches' output projections (out_proj, fc2) scaled down by
    sqrt(2 · n_layer) (two per block, Radford et al. 2019). muP (mup_width_scale != 1): the linear
    weights' standard deviation times sqrt(mup_width_scale), and their ``_optim`` dict gets
    ``lr_multiplier = mup_width_scale`` (flash-attn's hint to the optimizer setup)."""
    init_scale = math.sqrt(mup_width_scale)
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range * init_scale)
        if mup_width_scale != 1.0:
            module.weight._optim = {**getattr(module.weight, "_optim", {}), "lr_multiplier": mup_width_scale}
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.normal_(p, mean=0.0, std=initializer_range * init_scale / math.sqrt(2 * n_layer))


class GPTPreTrainedModel(nn.Module):
    """The config holder and ``from_pretrained``. The config: any object with GPT2Config's
    attribute names (see the module docstring), checked here (ValueError naming the attribute)."""

    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        check_config(config)
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name, config=None, *args, strict=True, device=None, dtype=None, world_size=1,
                        rank=0, state_dict=None, revision="main", token=None, cache_dir=None, local_files_only=False,
                        **kwargs):
        """flash-attn's ``from_pretrained(model_name, config, ...)``: the weights are
        ``state_dict`` if given, else read from ``model_name``: a local checkpoint file
        (``.safetensors``, read by cuflash's own reader, or a ``torch.save`` file), a local
        Hugging Face model directory (``config.json`` plus ``model.safetensors``,
        ``pytorch_model.bin`` or their sharded ``*.index.json``), or a Hugging Face hub model id
        (``"gpt2"``, ``"meta-llama/Llama-2-7b-hf"``) resolved through the local Hugging Face cache
        and downloaded into it when missing (``cuflash.utils.hub``: ``revision``, ``token``
        (else ``HF_TOKEN``), ``cache_dir``, ``local_files_only`` / ``HF_HUB_OFFLINE=1``; failures
        raise ``cuflash.utils.hub.HubError``, an OSError). ``config`` defaults to the
        checkpoint's config.json converted by its family's ``*_config_to_gpt2_config``. Hugging
        Face state dicts of every family in cuflash.models (GPT-2, Llama, GPT-NeoX, GPT-J, OPT,
        Falcon, BigCode, Baichuan, BTLM) are remapped (flash-attn picks the remap by the hub name;
        here config.json's ``model_type`` or, without one, the keys say it); a state dict already
        in this model's keys loads as it is. world_size > 1: this rank's shard
        (``shard_state_dict_tp``)."""
        from ._pretrained import resolve

        config, state_dict = resolve(model_name, config, state_dict, revision=revision, token=token,
                                     cache_dir=cache_dir, local_files_only=local_files_only)
        model = cls(config, *args, device=device, dtype=dtype, **kwargs)
        if dtype is not None:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        if world_size > 1:
            state_dict = shard_state_dict_tp(state_dict, config, world_size, rank)
        model.load_state_dict(state_dict, strict=strict)
        return model


class GPTModel(GPTPreTrainedModel):
    """flash-attn's ``GPTModel(config, process_group=None, device=None, dtype=None)``: see the
    module docstring. Attributes: embeddings, layers (nn.ModuleList of blocks), drop_f and ln_f
    (prenorm)."""

    def __init__(self, config, process_group=None, device=None, dtype=None):
        super().__init__(config)
        factory = dict(device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = _get(config, "sequence_parallel", True)
        self.residual_in_fp32 = _get(config, "residual_in_fp32", False)
        self.prenorm = _get(config, "prenorm", True)
        self.parallel_block = _get(config, "parallel_block", False)
        self.fused_dropout_add_ln = _get(config, "fused_dropout_add_ln", False)
        n_embd, vocab = _get(config, "n_embd"), _padded_vocab(config)
        positions = _get(config, "n_positions")
        if process_group is None:
            self.embeddings = GPT2Embeddings(n_embd, vocab, positions,
                                             word_embed_proj_dim=_get(config, "word_embed_proj_dim", None), **factory)
        else:
            if _get(config, "word_embed_proj_dim", None) is not None:
                raise ValueError("config.word_embed_proj_dim has no tensor-parallel form (process_group)")
            self.embeddings = ParallelGPT2Embeddings(n_embd, vocab, positions, process_group=process_group,
                                                     sequence_parallel=self.sequence_parallel, **factory)
        # flash-attn's order: dropout → add → norm → mixer / MLP (the same model as GPT-2's
        # norm → mixer / MLP → dropout → add, with the dropouts moved one step on)
        self.layers = nn.ModuleList([create_block(config, layer_idx=i, process_group=process_group, **factory)
                                     for i in range(_get(config, "n_layer"))])
        if self.prenorm:
            self.drop_f = nn.Dropout(_get(config, "resid_pdrop"))
            norm_cls = RMSNorm if _get(config, "rms_norm", False) else nn.LayerNorm
            self.ln_f = norm_cls(n_embd, eps=_get(config, "layer_norm_epsilon"), **factory)
            if process_group is not None:
                for p in self.ln_f.parameters():
                    p._shared_params = True
                    if self.sequence_parallel:
                        p._sequence_parallel = True
        self.embeddings_multiplier = _get(config, "mup_embeddings_multiplier", 1.0)
        self.apply(partial(_init_weights, n_layer=_get(config, "n_layer"),
                           initializer_range=_get(config, "initializer_range"),
                           mup_width_scale=_get(config, "mup_width_scale", 1.0)))
        self.tie_weights()

    def tie_weights(self):
        if self.process_group is not None:
            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def _final_norm(self, hidden_states, hidden_states2, residual):
        """drop_f → add → ln_f after the last block (prenorm)."""
        p = self.drop_f.p if self.training else 0.0
        if not self.fused_dropout_add_ln:
            dropped = self.drop_f(hidden_states)
            if self.parallel_block:
                dropped = dropped + self.drop_f(hidden_states2)
            residual = dropped + residual if residual is not None else dropped
            return self.ln_f(residual.to(dtype=self.ln_f.weight.dtype))
        return layer_norm_fn(hidden_states, self.ln_f.weight, self.ln_f.bias, residual=residual,
                             x1=hidden_states2 if self.parallel_block else None, eps=self.ln_f.eps, dropout_p=p,
                             prenorm=False, residual_in_fp32=self.residual_in_fp32,
                             is_rms_norm=isinstance(self.ln_f, RMSNorm))

    def forward(self, input_ids, position_ids=None, inference_params=None):
        """input_ids: (batch, seqlen) int; position_ids: (batch, seqlen) (decoding: the tokens'
        positions); inference_params: cuflash.utils.generation.InferenceParams (KV caches).
        Returns (batch, seqlen, n_embd); with a process group and sequence_parallel, this rank's
        (batch · seqlen / P, n_embd) rows."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        split_rows = self.process_group is not None and self.sequence_parallel
        hidden_states = self.embeddings(input_ids, position_ids=position_ids,
                                        **({"combine_batch_seqlen_dim": True} if split_rows else {}))
        if self.embeddings_multiplier != 1.0:      # muP (BTLM)
            hidden_states = hidden_states * self.embeddings_multiplier
        mixer_kwargs = {"seqlen": input_ids.shape[1]} if split_rows else {}
        if inference_params is not None:
            mixer_kwargs["inference_params"] = inference_params
        hidden_states2 = residual = None
        for layer in self.layers:
            if not self.prenorm:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            elif self.parallel_block:
                hidden_states, hidden_states2, residual = layer(hidden_states, hidden_states2, residual,
                                                                mixer_kwargs=mixer_kwargs)
            else:
                hidden_states, residual = layer(hidden_states, residual, mixer_kwargs=mixer_kwargs)
        if self.prenorm:
            hidden_states = self._final_norm(hidden_states, hidden_states2, residual)
        return hidden_states


class GPTLMHeadModel(GPTPreTrainedModel, GenerationMixin):
    """flash-attn's ``GPTLMHeadModel(config, process_group=None, device=None, dtype=None)``:
    ``transformer`` (GPTModel), ``project_out`` (word_embed_proj_dim) and ``lm_head`` (no bias
    unless lm_head_bias; a ColumnParallelLinear over a process group: this rank's vocabulary
    columns), tied to the word embedding with tie_word_embeddings. The vocabulary is padded up
    to pad_vocab_size_multiple (logits past vocab_size come from the padding rows)."""

    def __init__(self, config, process_group=None, device=None, dtype=None):
        factory = dict(device=device, dtype=dtype)
        super().__init__(config)
        self.process_group = process_group
        self.transformer = GPTModel(config, process_group=process_group, **factory)
        self.tie_word_embeddings = _get(config, "tie_word_embeddings")
        lm_head_bias = _get(config, "lm_head_bias", False)
        vocab = _padded_vocab(config)
        proj_dim = _get(config, "word_embed_proj_dim", None)
        n_embd = _get(config, "n_embd")
        width = n_embd if proj_dim is None else proj_dim
        self.project_out = None if proj_dim is None else nn.Linear(n_embd, width, bias=False, **factory)
        if process_group is None:
            self.lm_head = nn.Linear(width, vocab, bias=lm_head_bias, **factory)
        else:
            world = torch.distributed.get_world_size(process_group)
            if vocab % world:
                raise ValueError(f"the padded vocabulary ({vocab}: config.vocab_size rounded up to "
                                 f"config.pad_vocab_size_multiple) must be divisible by the process group's size "
                                 f"({world})")
            self.lm_head = ColumnParallelLinear(width, vocab, process_group, bias=lm_head_bias,
                                                sequence_parallel=_get(config, "sequence_parallel", True), **factory)
        mup_width_scale = _get(config, "mup_width_scale", 1.0)
        # muP (BTLM): the lm_head input scaled by mup_output_multiplier · mup_width_scale
        self.output_scale = _get(config, "mup_output_multiplier", 1.0) * mup_width_scale
        self.norm_head = _get(config, "norm_head", False)      # Baichuan 2: lm_head rows unit-normalized
        init = partial(_init_weights, n_layer=_get(config, "n_layer"),
                       initializer_range=_get(config, "initializer_range"), mup_width_scale=mup_width_scale)
        self.lm_head.apply(init)
        if self.project_out is not None:
            self.project_out.apply(init)
        self.tie_weights()

    def tie_weights(self):
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight
        if self.process_group is not None:
            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.transformer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        """input_ids: (batch, seqlen) int; num_last_tokens > 0: the logits of the last that many
        positions only. Returns CausalLMOutput(logits) with logits (batch, seqlen or
        num_last_tokens, padded vocab) (over a process group: this rank's vocabulary columns, or
        all of them when decoding with inference_params)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        if not isinstance(num_last_tokens, int) or num_last_tokens < 0:
            raise ValueError(f"num_last_tokens must be an int >= 0, got {num_last_tokens!r}")
        batch = input_ids.shape[0]
        hidden_states = self.transformer(input_ids, position_ids=position_ids, inference_params=inference_params)
        if inference_params is not None and hidden_states.dim() != 3:
            raise ValueError("inference_params: decoding needs config.sequence_parallel = False with a process group")
        if num_last_tokens > 0:
            if hidden_states.dim() != 3:
                raise ValueError("num_last_tokens needs (batch, seqlen, ...) hidden states (not sequence_parallel)")
            hidden_states = hidden_states[:, -num_last_tokens:]
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if self.output_scale != 1.0:
            hidden_states = hidden_states * self.output_scale
        if not self.norm_head:
            logits = self.lm_head(hidden_states)
        else:
            if isinstance(self.lm_head, ColumnParallelLinear) and self.lm_head.sequence_parallel:
                hidden_states = all_gather(hidden_states, self.lm_head.process_group)
            logits = F.linear(hidden_states, F.normalize(self.lm_head.weight), self.lm_head.bias)
        if isinstance(self.lm_head, ColumnParallelLinear) and inference_params is not None:
            # every rank its vocabulary columns → all of them: gathered on dim 0, then side by side
            gathered, _ = all_gather_raw(logits, self.lm_head.process_group)
            logits = torch.cat(gathered.split(batch, dim=0), dim=-1)
        return CausalLMOutput(logits=logits)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """nn.Module's, after moving the norms of flash-attn's older checkpoints (those with
        ``transformer.ln_0``: norm after the mixer / MLP) to this layout (norm before)."""
        if "transformer.ln_0.weight" in state_dict:
            state_dict = _move_old_norms(dict(state_dict), len(self.transformer.layers))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _move_old_norms(sd: dict, n_layers: int) -> dict:
    """Old layout: ln_0 before layer 0, layer l's norm1 after its mixer and norm2 after its MLP.
    New: layer l's norm1 before its mixer (old: ln_0 for l = 0, else layer l - 1's norm2), its
    norm2 before its MLP (old: its norm1), ln_f at the end (old: the last layer's norm2)."""
    old = {}
    for suffix in ("weight", "bias"):
        old[("ln_0", suffix)] = sd.pop(f"transformer.ln_0.{suffix}", None)
        for l in range(n_layers):
            for n in (1, 2):
                old[(l, n, suffix)] = sd.pop(f"transformer.layers.{l}.norm{n}.{suffix}", None)
    for suffix in ("weight", "bias"):
        moves = {"transformer.ln_f": old[(n_layers - 1, 2, suffix)]}
        for l in range(n_layers):
            moves[f"transformer.layers.{l}.norm1"] = old[("ln_0", suffix)] if l == 0 else old[(l - 1, 2, suffix)]
            moves[f"transformer.layers.{l}.norm2"] = old[(l, 1, suffix)]
        for key, value in moves.items():
            if value is not None:
                sd[f"{key}.{suffix}"] = value
    return sd


# ---------------------------------------------------------------------------------------
# checkpoints

def _pad_rows(weight, rows: int):
    """weight with zero rows appended up to `rows` (a padded vocabulary)."""
    if weight.shape[0] > rows:
        raise ValueError(f"the checkpoint's vocabulary ({weight.shape[0]} rows) is larger than the config's padded "
                         f"vocabulary ({rows})")
    return F.pad(weight, (0, 0, 0, rows - weight.shape[0]))


def remap_state_dict_hf_gpt2(state_dict, config):
    """A Hugging Face GPT-2 state dict (``wte``, ``wpe``, ``h.{i}.ln_1 / attn.c_attn / attn.c_proj
    / ln_2 / mlp.c_fc / mlp.c_proj``, ``ln_f``; with or without the ``transformer.`` prefix of
    GPT2LMHeadModel) → GPTLMHeadModel's keys: the Conv1D weights (in, out) transposed to linear
    (out, in), the word embedding padded to the padded vocabulary and shared by ``lm_head``, the
    causal-mask buffers (``attn.bias``, ``attn.masked_bias``) dropped. Returns a new OrderedDict."""
    vocab = _padded_vocab(config)
    src = OrderedDict((re.sub(r"^transformer\.", "", k), v) for k, v in state_dict.items())
    src.pop("lm_head.weight", None)           # GPT-2 ties it to wte
    out = OrderedDict()
    layer_names = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "mixer.Wqkv", "attn.c_proj": "mixer.out_proj",
                   "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for key, value in src.items():
        if key == "wte.weight":
            out["transformer.embeddings.word_embeddings.weight"] = _pad_rows(value, vocab)
            continue
        if key == "wpe.weight":
            out["transformer.embeddings.position_embeddings.weight"] = value
            continue
        m = re.match(r"^ln_f\.(weight|bias)$", key)
        if m:
            out[f"transformer.ln_f.{m.group(1)}"] = value
            continue
        m = re.match(r"^h\.(\d+)\.(.+)\.(weight|bias)$", key)
        if m and m.group(2) in layer_names:
            layer, name, kind = m.groups()
            conv = name.startswith(("attn.", "mlp.")) and kind == "weight"   # Conv1D: (in, out)
            out[f"transformer.layers.{layer}.{layer_names[name]}.{kind}"] = value.t() if conv else value
            continue
        if re.match(r"^h\.\d+\.attn\.(masked_)?bias$", key):
            continue                          # the causal mask buffers
        raise ValueError(f"remap_state_dict_hf_gpt2: unexpected key {key!r} in the GPT-2 state dict")
    out["lm_head.weight"] = out["transformer.embeddings.word_embeddings.weight"]
    return out


def _tp_sizes(config, world_size):
    n_head = _get(config, "n_head")
    n_head_kv = _get(config, "n_head_kv", None) or n_head
    return n_head, n_head_kv, _head_dim(config), _get(config, "n_layer")


def shard_state_dict_tp(state_dict, config, world_size, rank):
    """Rank ``rank``'s state dict of the tensor-parallel GPTLMHeadModel (process group of
    ``world_size`` ranks) from the whole model's: the vocabulary rows of the word embedding and
    lm_head, the columns of the position embedding, each layer's heads (``shard_mha_state_dict``:
    Wqkv rows, out_proj columns) and hidden units (fc1 rows (a gated MLP: the rank's y rows, then
    its gate rows), fc2 columns), the row-parallel biases on rank 0. Splits as the parallel
    modules make them (``get_dim_for_local_rank``). Returns a new dict."""
    from ..modules.mha import shard_mha_state_dict

    n_head, n_head_kv, head_dim, n_layer = _tp_sizes(config, world_size)
    vocab = _padded_vocab(config)
    if vocab % world_size:
        raise ValueError(f"the padded vocabulary ({vocab}) must be divisible by world_size ({world_size})")
    sd = dict(state_dict)
    rows = slice(rank * vocab // world_size, (rank + 1) * vocab // world_size)
    for key in ("transformer.embeddings.word_embeddings.weight", "lm_head.weight", "lm_head.bias"):
        if key in sd:
            sd[key] = sd[key][rows]
    key = "transformer.embeddings.position_embeddings.weight"
    if key in sd:
        width = sd[key].shape[-1] // world_size
        sd[key] = sd[key][..., rank * width:(rank + 1) * width]
    gated = _get(config, "activation_function") in _GATED
    for i in range(n_layer):
        sd = shard_mha_state_dict(sd, n_head, n_head_kv, world_size, rank, prefix=f"transformer.layers.{i}.mixer.")
        p = f"transformer.layers.{i}.mlp."
        if p + "fc2.weight" not in sd:
            continue
        a, b = local_range(sd[p + "fc2.weight"].shape[-1], world_size, rank)
        for name in ("fc1.weight", "fc1.bias"):
            if p + name in sd:
                w = sd[p + name]
                sd[p + name] = torch.cat([half[a:b] for half in w.chunk(2, dim=0)]) if gated else w[a:b]
        sd[p + "fc2.weight"] = sd[p + "fc2.weight"][:, a:b]
        if rank != 0:
            sd.pop(p + "fc2.bias", None)
    return sd


def combine_state_dicts_tp(state_dicts, config):
    """The whole model's state dict from the ranks' (rank order): the inverse of
    shard_state_dict_tp."""
    from ..modules.mha import combine_mha_state_dicts

    n_head, n_head_kv, head_dim, n_layer = _tp_sizes(config, len(state_dicts))
    sd = dict(state_dicts[0])
    for key in ("transformer.embeddings.word_embeddings.weight", "lm_head.weight", "lm_head.bias"):
        if key in sd:
            sd[key] = torch.cat([s[key] for s in state_dicts], dim=0)
    key = "transformer.embeddings.position_embeddings.weight"
    if key in sd:
        sd[key] = torch.cat([s[key] for s in state_dicts], dim=-1)
    gated = _get(config, "activation_function") in _GATED
    for i in range(n_layer):
        prefix = f"transformer.layers.{i}.mixer."
        mixer = combine_mha_state_dicts([{k: v for k, v in s.items() if k.startswith(prefix)} for s in state_dicts],
                                        n_head, n_head_kv, prefix=prefix)
        sd.update(mixer)
        p = f"transformer.layers.{i}.mlp."
        for name in ("fc1.weight", "fc1.bias"):
            if p + name in sd:
                parts = [s[p + name] for s in state_dicts]
                if gated:
                    halves = [part.chunk(2, dim=0) for part in parts]
                    sd[p + name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                else:
                    sd[p + name] = torch.cat(parts)
        if p + "fc2.weight" in sd:
            sd[p + "fc2.weight"] = torch.cat([s[p + "fc2.weight"] for s in state_dicts], dim=-1)
    return sd
