"""What the Hugging Face checkpoint helpers of cuflash.models share: reading a config's attributes
by any of their names (ValueError naming the attribute when absent), the vocabulary padding,
and renaming a state dict's keys by a table of patterns (keys no pattern maps raise)."""
from __future__ import annotations

import math
import re
from collections import OrderedDict

import torch.nn.functional as F

from .gpt import _get

_MISSING = object()


def attr(config, names, who: str, default=_MISSING):
    """The first of config's attributes `names` (a name or a tuple of aliases) that is present,
    else `default`; without a default a missing one raises ValueError naming it."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        if hasattr(config, name):
            return getattr(config, name)
    if default is not _MISSING:
        return default
    raise ValueError(f"{who}.{names[0]} is missing ({type(config).__name__}; it needs the Hugging Face config's "
                     f"attribute names{', or ' + ' / '.join(names[1:]) if len(names) > 1 else ''})")


def padded_vocab(config) -> int:
    """GPT2Config's vocab_size rounded up to pad_vocab_size_multiple."""
    multiple = _get(config, "pad_vocab_size_multiple", 1)
    return math.ceil(_get(config, "vocab_size") / multiple) * multiple


def pad_embeddings_and_head(sd, config, who: str) -> None:
    """In place on a renamed state dict: the word embeddings and the lm_head weight (the
    embeddings' tensor when config.tie_word_embeddings) and bias padded to the padded vocabulary."""
    vocab = padded_vocab(config)
    word = "transformer.embeddings.word_embeddings.weight"
    sd[word] = pad_rows(pop(sd, word, who), vocab)
    if _get(config, "tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
        sd["lm_head.weight"] = sd[word]
    else:
        sd["lm_head.weight"] = pad_rows(pop(sd, "lm_head.weight", who), vocab)
    if "lm_head.bias" in sd:
        sd["lm_head.bias"] = pad_rows(sd["lm_head.bias"], vocab)


def pad_rows(weight, rows: int, value=0.0):
    """weight (rows first) padded with `value` up to `rows` rows."""
    if weight.shape[0] > rows:
        raise ValueError(f"the checkpoint's vocabulary ({weight.shape[0]} rows) is larger than the config's padded "
                         f"vocabulary ({rows})")
    pad = (0, 0) * (weight.dim() - 1) + (0, rows - weight.shape[0])
    return F.pad(weight, pad, value=value)


def rename(state_dict, table, who: str, drop=()) -> OrderedDict:
    """Each key through the first (pattern, replacement) of `table` that matches it in full
    (re.fullmatch; replacement None drops the key); keys matching a pattern of `drop` are dropped;
    a key nothing matches raises ValueError naming it."""
    out = OrderedDict()
    for key, value in state_dict.items():
        if any(re.fullmatch(p, key) for p in drop):
            continue
        for pattern, repl in table:
            m = re.fullmatch(pattern, key)
            if m:
                if repl is not None:
                    out[m.expand(repl)] = value
                break
        else:
            raise ValueError(f"{who}: unexpected key {key!r} in the state dict")
    return out


def pop(sd, key, who: str):
    try:
        return sd.pop(key)
    except KeyError:
        raise ValueError(f"{who}: the state dict lacks {key!r}") from None
