"""Token and position embeddings with flash-attn 2.8's names, constructor arguments, forwards and
state-dict keys (``word_embeddings``, ``position_embeddings``, ``project_in``): ``from
flash_attn.modules.embedding import GPT2Embeddings`` becomes ``from cuflash.modules.embedding
import GPT2Embeddings``. Plain torch (``nn.Embedding``, ``torch.distributed``).

* ``GPT2Embeddings``: word embedding plus a learned absolute position embedding (none when
  ``max_position_embeddings <= 0``: rotary models); ``word_embed_proj_dim`` (OPT-350m) embeds to
  that width and projects up to ``embed_dim`` with ``project_in`` (no bias).
* ``BertEmbeddings``: word + learned absolute position (none when ``max_position_embeddings <=
  0``) + token type embeddings (none when ``type_vocab_size <= 0``; ``token_type_ids`` default
  to zeros).
* ``VocabParallelEmbedding``: each rank of a process group holds ``num_embeddings / P``
  consecutive rows of the vocabulary; ids outside the rank's rows embed to zeros (the ranks'
  partial embeddings sum to the full one).
* ``ColumnParallelEmbedding``: each rank holds ``embedding_dim / P`` consecutive columns.
* ``ParallelGPT2Embeddings``: the two above; the partial sums are reduce-scattered over the
  group (``sequence_parallel=True``: each rank gets its rows of the (batch · seqlen, embed_dim)
  result, flash-attn's layout) or all-reduced (every rank the whole result).

Bad arguments raise ``ValueError`` naming the argument (flash-attn raises on the same cases):
a vocabulary or width that the ranks do not divide, ``padding_idx`` with more than one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..utils.distributed import all_reduce, reduce_scatter

__all__ = ["GPT2Embeddings", "BertEmbeddings", "VocabParallelEmbedding", "ColumnParallelEmbedding",
           "ParallelGPT2Embeddings"]


def _positions(input_ids: Tensor, position_ids):
    """position_ids, or 0 .. seqlen - 1 (broadcast over the batch)."""
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)


def _check_ids(input_ids) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be an integer tensor (batch, seqlen), got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")


class GPT2Embeddings(nn.Module):
    """flash-attn's ``GPT2Embeddings(embed_dim, vocab_size, max_position_embeddings,
    padding_idx=None, word_embed_proj_dim=None, device=None, dtype=None)``; ``forward(input_ids,
    position_ids=None)`` returns (batch, seqlen, embed_dim)."""

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, padding_idx=None, word_embed_proj_dim=None,
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        width = embed_dim if word_embed_proj_dim is None else word_embed_proj_dim
        self.word_embeddings = nn.Embedding(vocab_size, width, padding_idx=padding_idx, **factory)
        self.project_in = (None if word_embed_proj_dim is None
                           else nn.Linear(word_embed_proj_dim, embed_dim, bias=False, **factory))
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)

    def forward(self, input_ids, position_ids=None):
        """input_ids: (batch, seqlen) int; position_ids: (batch, seqlen) or (seqlen,), default
        0 .. seqlen - 1."""
        _check_ids(input_ids)
        out = self.word_embeddings(input_ids)
        if self.project_in is not None:
            out = self.project_in(out)
        if self.max_position_embeddings > 0:
            out = out + self.position_embeddings(_positions(input_ids, position_ids))
        return out


class BertEmbeddings(nn.Module):
    """flash-attn's ``BertEmbeddings(embed_dim, vocab_size, max_position_embeddings,
    type_vocab_size, padding_idx=None, device=None, dtype=None)``; ``forward(input_ids,
    position_ids=None, token_type_ids=None)`` returns (batch, seqlen, embed_dim)."""

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, type_vocab_size, padding_idx=None,
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx, **factory)
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)
        if type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(type_vocab_size, embed_dim, **factory)

    def forward(self, input_ids, position_ids=None, token_type_ids=None):
        """input_ids, token_type_ids: (batch, seqlen) int (token types default to 0);
        position_ids: (batch, seqlen) or (seqlen,), default 0 .. seqlen - 1."""
        _check_ids(input_ids)
        out = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            out = out + self.position_embeddings(_positions(input_ids, position_ids))
        if self.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            out = out + self.token_type_embeddings(token_type_ids)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """flash-attn's ``VocabParallelEmbedding(num_embeddings, *args, process_group=None,
    padding_idx=None, **kwargs)``: this rank's ``num_embeddings / P`` rows of the vocabulary
    (rank r: ids r · n .. (r + 1) · n - 1); other ids give zero rows. Without a process group:
    ``nn.Embedding``."""

    def __init__(self, num_embeddings, *args, process_group=None, padding_idx=None, **kwargs):
        self.process_group = process_group
        world = dist.get_world_size(process_group) if process_group is not None else 1
        if num_embeddings % world:
            raise ValueError(f"num_embeddings ({num_embeddings}) must be divisible by the process group's size "
                             f"({world})")
        if world > 1 and padding_idx is not None:
            raise ValueError("padding_idx is not supported with a vocabulary split over more than one rank")
        super().__init__(num_embeddings // world, *args, padding_idx=padding_idx, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        if self.process_group is None or dist.get_world_size(self.process_group) == 1:
            return super().forward(input)
        first = dist.get_rank(self.process_group) * self.num_embeddings
        outside = (input < first) | (input >= first + self.num_embeddings)
        local = torch.where(outside, torch.zeros_like(input), input - first)
        return super().forward(local).masked_fill(outside[..., None], 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """flash-attn's ``ColumnParallelEmbedding(num_embeddings, embedding_dim, *args,
    process_group=None, **kwargs)``: this rank's ``embedding_dim / P`` columns."""

    def __init__(self, num_embeddings, embedding_dim, *args, process_group=None, **kwargs):
        self.process_group = process_group
        world = dist.get_world_size(process_group) if process_group is not None else 1
        if embedding_dim % world:
            raise ValueError(f"embedding_dim ({embedding_dim}) must be divisible by the process group's size "
                             f"({world})")
        super().__init__(num_embeddings, embedding_dim // world, *args, **kwargs)


class ParallelGPT2Embeddings(nn.Module):
    """flash-attn's ``ParallelGPT2Embeddings(embed_dim, vocab_size, max_position_embeddings,
    process_group, padding_idx=None, sequence_parallel=True, device=None, dtype=None)``;
    ``forward(input_ids, position_ids=None, combine_batch_seqlen_dim=False)``: the rank's partial
    embedding (its vocabulary rows, its position columns), summed over the group: reduce-scattered
    along dimension 0 with ``sequence_parallel`` (combine_batch_seqlen_dim: over the
    (batch · seqlen, embed_dim) rows, the layout ``ParallelMHA(seqlen=...)`` reads), all-reduced
    otherwise."""

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, process_group, padding_idx=None,
                 sequence_parallel=True, device=None, dtype=None):
        super().__init__()
        if process_group is None:
            raise ValueError("process_group must be a torch.distributed process group (the tensor-parallel "
                             "ranks), got None")
        factory = dict(device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                                      process_group=process_group, **factory)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(max_position_embeddings, embed_dim,
                                                               process_group=process_group, **factory)

    def forward(self, input_ids, position_ids=None, combine_batch_seqlen_dim=False):
        _check_ids(input_ids)
        world = dist.get_world_size(self.process_group)
        out = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            pos = self.position_embeddings(_positions(input_ids, position_ids))
            if world == 1:
                out = out + pos
            else:   # this rank's columns of the position embedding: added on its column slice only
                width = self.position_embeddings.embedding_dim
                first = dist.get_rank(self.process_group) * width
                pad = (first, out.shape[-1] - first - width)
                out = out + nn.functional.pad(pos, pad)
        if combine_batch_seqlen_dim:
            out = out.flatten(0, 1)
        if world == 1:
            return out
        return reduce_scatter(out, self.process_group) if self.sequence_parallel else all_reduce(
            out, self.process_group)
