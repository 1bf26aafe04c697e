"""``GPTPreTrainedModel.from_pretrained``'s checkpoint side: where it is (a local path, or a hub
model id through the Hugging Face cache: ``cuflash.utils.hub``), which family it is (the
directory's ``config.json`` ``model_type``, else its state dict's keys), that family's config
conversion (``*_config_to_gpt2_config``) when no config is given, and its remap
(``remap_state_dict_hf_*``)."""
from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping

from ..api import UnsupportedFeature
from ._checkpoint import load_hf_config, load_state_dict_from, resolve_source

# model_type (config.json) → (module, config conversion (None: GPT-2's own names), remap)
FAMILIES = {
    "gpt2": ("gpt", None, "remap_state_dict_hf_gpt2"),
    "llama": ("llama", "llama_config_to_gpt2_config", "remap_state_dict_hf_llama"),
    "gpt_neox": ("gpt_neox", "gpt_neox_config_to_gpt2_config", "remap_state_dict_hf_gpt_neox"),
    "gptj": ("gptj", "gptj_config_to_gpt2_config", "remap_state_dict_hf_gptj"),
    "opt": ("opt", "opt_config_to_gpt2_config", "remap_state_dict_hf_opt"),
    "falcon": ("falcon", "falcon_config_to_gpt2_config", "remap_state_dict_hf_falcon"),
    "RefinedWeb": ("falcon", "falcon_config_to_gpt2_config", "remap_state_dict_hf_falcon"),
    "RefinedWebModel": ("falcon", "falcon_config_to_gpt2_config", "remap_state_dict_hf_falcon"),
    "gpt_bigcode": ("bigcode", "bigcode_config_to_gpt2_config", "remap_state_dict_hf_bigcode"),
    "baichuan": ("baichuan", "baichuan_config_to_gpt2_config", "remap_state_dict_hf_baichuan"),
    "btlm": ("btlm", "btlm_config_to_gpt2_config", "remap_state_dict_hf_btlm"),
}


def _any(keys, pattern) -> bool:
    return any(re.match(pattern, k) for k in keys)


def family_from_keys(state_dict) -> str | None:
    """The Hugging Face family a state dict's keys say (None: none of them, or already
    GPTLMHeadModel's keys)."""
    keys = list(state_dict)
    if _any(keys, r"transformer\.(layers|embeddings)\."):
        return None                                   # flash-attn / cuflash layout
    if _any(keys, r"model\.layers\.\d+\.self_attn\.W_pack\."):
        return "baichuan"
    if _any(keys, r"model\.(embed_tokens|layers)\."):
        return "llama"
    if _any(keys, r"(gpt_neox\.)?(embed_in|layers\.\d+\.attention\.query_key_value)\."):
        return "gpt_neox"
    if _any(keys, r"(model\.)?decoder\.(embed_tokens|layers)\."):
        return "opt"
    if _any(keys, r"transformer\.(word_embeddings|h\.\d+\.self_attention)\."):
        return "falcon"
    if _any(keys, r"transformer\.(relative_pe\.|h\.\d+\.mlp\.c_fc2\.)"):
        return "btlm"
    if _any(keys, r"transformer\.h\.\d+\.attn\.q_proj\."):
        return "gptj"
    c_attn = next((v for k, v in state_dict.items() if re.match(r"(transformer\.)?h\.\d+\.attn\.c_attn\.weight$", k)),
                  None)
    if c_attn is not None:     # GPT-2's Conv1D is (in, out) = (n, 3n); GPTBigCode's Linear (out, in)
        return "gpt_bigcode" if c_attn.shape[0] > c_attn.shape[1] else "gpt2"
    if _any(keys, r"(transformer\.)?(wte|h\.\d+)\."):
        return "gpt2"
    return None


def _family_module(family: str):
    if family not in FAMILIES:
        raise UnsupportedFeature(f"from_pretrained: model_type {family!r} is not one of cuflash's GPT families "
                                 f"({', '.join(sorted(FAMILIES))})")
    module, convert, remap = FAMILIES[family]
    return importlib.import_module(f"{__package__}.{module}"), convert, remap


def convert_config(family: str, hf_config):
    """GPT2Config of a Hugging Face config of `family`."""
    module, convert, _ = _family_module(family)
    if convert is None:
        from .gpt import GPT2Config
        return GPT2Config(**{k: v for k, v in vars(hf_config).items() if k != "model_type"})
    return getattr(module, convert)(hf_config)


def resolve(model_name, config, state_dict, **hub):
    """(config, state dict in GPTLMHeadModel's keys) for from_pretrained: the weights are
    `state_dict` if given, else read from `model_name` (a local file or model directory, or a hub
    model id resolved through the Hugging Face cache: ``hub`` holds revision, token, cache_dir,
    local_files_only); the config is `config` if given, else converted from the directory's
    config.json."""
    hf_config = None
    if state_dict is None:
        path = resolve_source(model_name, "from_pretrained", **hub)
        if os.path.isdir(path):
            hf_config = load_hf_config(path)
        state_dict = load_state_dict_from(path)
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a mapping of tensors, got {type(state_dict).__name__}")
    model_type = getattr(hf_config, "model_type", None) if hf_config is not None else None
    if config is None:
        if model_type is None:
            raise ValueError(f"from_pretrained({model_name!r}): config is needed (no config.json with a model_type "
                             "to convert)")
        config = convert_config(model_type, hf_config)
    family = family_from_keys(state_dict)      # None: already this model's keys
    if family is not None:
        if model_type is not None and model_type in FAMILIES and FAMILIES[model_type][0] != FAMILIES[family][0]:
            family = model_type               # config.json has the last word (e.g. GPT-2-like key names)
        module, _, remap = _family_module(family)
        state_dict = getattr(module, remap)(state_dict, config)
    return config, state_dict
