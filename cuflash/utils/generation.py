"""flash-attn's ``flash_attn.utils.generation`` names: ``InferenceParams`` (the decoding state that
``MHA.forward(..., inference_params=...)`` reads and whose KV caches it keeps) and the generation
loop: ``decode`` (greedy, top-k, top-p, min-p, temperature, repetition penalty, teacher forcing),
``sample``, the logit filters and ``GenerationMixin`` (``model.generate(input_ids, max_length,
...)``, as ``cuflash.models.gpt.GPTLMHeadModel`` has it).

The loop runs the prompt once through the model (filling each layer's KV cache), then one token
at a time with ``inference_params.seqlen_offset`` at the tokens already cached: with
``use_flash_attn=True`` models, each step's attention is ``flash_attn_with_kvcache`` (rotary and
the cache append fused into it where the rotary dimension allows).

Differences from flash-attn: the outputs are this module's ``GreedySearchDecoderOnlyOutput`` /
``SampleDecoderOnlyOutput`` dataclasses (``sequences``, ``scores``; transformers is not needed);
``cg=True`` (flash-attn's CUDA-graph capture of the decoding step) is accepted and runs the same
steps without graphs (same tokens, no capture); ``min_p`` applies with any ``top_k`` (flash-attn's
only with ``top_k=0``); ``max_length`` must exceed the prompt's length (flash-attn then returns one
token past max_length) and the sampling arguments are checked (``ValueError`` naming them)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


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


@dataclass
class GreedySearchDecoderOnlyOutput:
    """decode's result with top_k == 1: sequences (batch, <= max_length), the prompt first;
    scores: one (batch, vocab) logits tensor per generated token (empty unless output_scores)."""
    sequences: Any
    scores: Optional[tuple] = None


@dataclass
class SampleDecoderOnlyOutput(GreedySearchDecoderOnlyOutput):
    """decode's result with sampling (top_k != 1): the same fields."""


def modify_logits_for_top_p_filtering(logits, top_p) -> None:
    """In place: -inf at the tokens outside the top-p nucleus of each row (the fewest most
    likely tokens whose probabilities, in fp32, sum to at least top_p). top_p <= 0 or >= 1: no
    change."""
    if top_p <= 0.0 or top_p >= 1.0:
        return
    ascending, order = torch.sort(logits, dim=-1)
    tail = ascending.float().softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p   # the least likely mass below 1 - top_p
    logits.masked_fill_(tail.scatter(-1, order, tail), float("-inf"))


def modify_logits_for_min_p_filtering(logits, min_p) -> None:
    """In place: -inf at the tokens whose probability is below min_p times the row's largest.
    min_p <= 0 or > 1: no change."""
    if min_p <= 0.0 or min_p > 1.0:
        return
    probs = logits.float().softmax(dim=-1)
    logits.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def modify_logit_for_repetition_penalty(logits, prev_output_tokens, repetition_penalty=1.0):
    """The CTRL penalty (Keskar et al. 2019), in place: at each token already in the row's
    prev_output_tokens (batch, n), a positive logit divided by the penalty, a negative one
    multiplied. Returns logits."""
    if repetition_penalty == 1.0:
        return logits
    seen = torch.gather(logits, 1, prev_output_tokens)
    seen = torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty)
    logits.scatter_(1, prev_output_tokens, seen)
    return logits


def _check_sampling(top_k, top_p, min_p, temperature) -> None:
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no top-k limit, 1: greedy), got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p!r}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def sample(logits, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0):
    """One token per row of logits (batch, vocab): the argmax with top_k == 1; otherwise a draw
    from softmax(logits / temperature) restricted to the top_k largest logits (all with top_k =
    0), then to the top-p nucleus, then to the tokens within min_p of the most likely. Returns
    (batch,) int64."""
    _check_sampling(top_k, top_p, min_p, temperature)
    if top_k == 1:
        return logits.argmax(dim=-1)
    if top_k > 0:
        kept, indices = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
    else:
        kept, indices = logits, None
    kept = kept / temperature if temperature != 1.0 else kept.clone()
    modify_logits_for_top_p_filtering(kept, top_p)
    modify_logits_for_min_p_filtering(kept, min_p)
    drawn = torch.multinomial(torch.softmax(kept.float(), dim=-1), num_samples=1).squeeze(-1)   # fp32 probabilities
    return drawn if indices is None else indices.gather(-1, drawn[:, None]).squeeze(-1)


@torch.inference_mode()
def decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0, repetition_penalty=1.0,
           eos_token_id=None, teacher_outputs=None, vocab_size=None, cg=False, enable_timing=False,
           output_scores=False, streamer=None):
    """flash-attn's ``decode``: tokens until each row has max_length tokens (prompt included) or
    every row's last token is eos_token_id. input_ids: (batch, seqlen) int, all rows the same
    length; model(input_ids, position_ids=..., inference_params=..., num_last_tokens=1) must
    return an object with ``logits`` (batch, 1, vocab). teacher_outputs (batch, n): where it has
    a token for a position, that token is taken instead of a sampled one. vocab_size: logits past
    it are dropped (a padded vocabulary). cg: accepted, runs without CUDA graphs (see the module
    docstring). enable_timing: prints the prompt + decoding time. streamer: ``put`` gets the
    prompt then each new token (on the CPU), ``end`` at the end. Returns
    GreedySearchDecoderOnlyOutput (top_k == 1) or SampleDecoderOnlyOutput."""
    _check_sampling(top_k, top_p, min_p, temperature)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    batch, prompt_len = input_ids.shape
    if not isinstance(max_length, int) or max_length <= prompt_len:
        raise ValueError(f"max_length must be an int larger than the prompt's length ({prompt_len}), got "
                         f"{max_length!r}")
    if repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    params = InferenceParams(max_seqlen=max_length, max_batch_size=batch)
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    if enable_timing:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()

    sequences, scores, history = [input_ids], [], input_ids
    while True:
        last = sequences[-1]
        if params.seqlen_offset > 0 and ((eos_token_id is not None and bool((last == eos_token_id).all()))
                                          or params.seqlen_offset >= max_length - 1):
            break
        position_ids = (None if params.seqlen_offset == 0 else
                        torch.full((batch, 1), params.seqlen_offset, dtype=torch.long, device=input_ids.device))
        logits = model(last, position_ids=position_ids, inference_params=params, num_last_tokens=1).logits[:, -1]
        if vocab_size is not None:
            logits = logits[..., :vocab_size]
        if output_scores:
            scores.append(logits.clone())
        params.seqlen_offset += last.shape[1]
        if repetition_penalty != 1.0:
            logits = modify_logit_for_repetition_penalty(logits.clone(), history, repetition_penalty)
        if params.seqlen_offset < teacher_len:
            token = teacher_outputs[:, params.seqlen_offset]
        else:
            token = sample(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
        token = token[:, None]
        sequences.append(token)
        if repetition_penalty != 1.0:
            history = torch.cat([history, token], dim=1)
        if streamer is not None:
            streamer.put(token.cpu())
    if streamer is not None:
        streamer.end()
    if enable_timing:
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        print(f"Prompt processing + decoding time: {(time.perf_counter() - start) * 1000:.0f}ms")
    cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return cls(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


class GenerationMixin:
    """flash-attn's ``GenerationMixin``: ``generate(input_ids, max_length, top_k=1, top_p=0.0,
    min_p=0.0, temperature=1.0, return_dict_in_generate=False, output_scores=False, **kwargs)``
    runs ``decode`` on this model (kwargs: decode's other arguments) and returns the sequences
    (batch, <= max_length), or decode's output with return_dict_in_generate (scores None unless
    output_scores)."""

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        raise NotImplementedError

    def generate(self, input_ids, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
                 return_dict_in_generate=False, output_scores=False, **kwargs):
        out = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature,
                     output_scores=output_scores, **kwargs)
        if not output_scores:
            out.scores = None
        return out if return_dict_in_generate else out.sequences
