"""flash-attn's ``flash_attn.utils.pretrained``: ``state_dict_from_pretrained(model_name, device,
dtype)``, the checkpoint's own state dict (its keys unmapped), and ``config_from_pretrained``, its
config.json as a ``types.SimpleNamespace`` (what cuflash.models' ``*_config_to_gpt2_config`` take
in place of a transformers config). ``model_name`` is a local checkpoint file or model directory,
or a Hugging Face hub model id resolved through the local Hugging Face cache and downloaded into it
when missing (``cuflash.utils.hub``; transformers is not needed)."""
from __future__ import annotations

import os

__all__ = ["state_dict_from_pretrained", "config_from_pretrained"]


def state_dict_from_pretrained(model_name, device=None, dtype=None, *, revision="main", token=None, cache_dir=None,
                               local_files_only=False):
    """The state dict of `model_name` (all shards merged; safetensors preferred over
    pytorch_model.bin, as flash-attn), its floating tensors cast to `dtype` (read on the CPU,
    cast, then moved to `device`; integer buffers keep their dtype) and moved to `device`."""
    import torch

    from ..models._checkpoint import load_state_dict_from

    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    state_dict = load_state_dict_from(model_name, "state_dict_from_pretrained", revision=revision, token=token,
                                      cache_dir=cache_dir, local_files_only=local_files_only)
    if dtype is not None:
        state_dict = {k: v.to(dtype=dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if device is not None:
        state_dict = {k: v.to(device) for k, v in state_dict.items()}
    return dict(state_dict)


def config_from_pretrained(model_name, *, revision="main", token=None, cache_dir=None, local_files_only=False):
    """The config.json of a local model directory (or of the directory of a local checkpoint
    file) or of a hub model id (only config.json is downloaded) as a SimpleNamespace."""
    from ..models._checkpoint import load_hf_config
    from . import hub

    if isinstance(model_name, (str, os.PathLike)) and os.path.exists(model_name):
        folder = model_name if os.path.isdir(model_name) else os.path.dirname(os.path.abspath(model_name))
    elif hub.is_repo_id(model_name):
        try:
            path = hub.cached_file(model_name, "config.json", revision=revision, token=token, cache_dir=cache_dir,
                                   local_files_only=local_files_only)
        except hub.HubError as err:
            raise type(err)(f"config_from_pretrained({model_name!r}): {err}") from None
        folder = os.path.dirname(path)
    else:
        raise FileNotFoundError(f"config_from_pretrained({model_name!r}): no such local file or directory, and not "
                                "a Hugging Face hub model id ('name' or 'org/name')")
    config = load_hf_config(folder)
    if config is None:
        raise FileNotFoundError(f"config_from_pretrained({model_name!r}): no config.json in {folder}")
    return config
