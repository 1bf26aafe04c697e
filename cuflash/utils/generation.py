"""``InferenceParams``: the decoding state that ``MHA.forward(..., inference_params=...)`` reads
and whose KV caches it keeps, with the fields of flash-attn's ``flash_attn.utils.generation``
(flash-attn's generation loop itself is not part of cuflash)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class InferenceParams:
    """max_seqlen, max_batch_size: the KV caches' size; seqlen_offset: tokens already in the
    caches (0 for the prompt); batch_size_offset: the first cache row of this batch;
    key_value_memory_dict: layer_idx -> that layer's cache (batch, max_seqlen, 2, nheads_kv,
    headdim); lengths_per_sample: int32 (batch,) per-row lengths, when rows differ (else
    seqlen_offset for all)."""
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: Optional[Any] = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        """Start a new generation: new sizes, no token in the caches."""
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()
