"""flash-attn's ``flash_attn.utils.generation`` names: ``InferenceParams`` (the decoding state that
``MHA.forward(..., inference_params=...)`` reads and whose KV caches it keeps), the generation
loop: ``decode`` (greedy, top-k, top-p, min-p, temperature, repetition penalty, teacher forcing),
``sample``, the logit filters and ``GenerationMixin`` (``model.generate(input_ids, max_length,
...)``, as ``cuflash.models.gpt.GPTLMHeadModel`` has it), and the CUDA-graph decoding step:
``DecodingCGCache``, ``update_graph_cache``, ``capture_graph`` (``decode(..., cg=True)``).

The loop runs the prompt once through the model (filling each layer's KV cache), then one token
at a time with ``inference_params.seqlen_offset`` at the tokens already cached: with
``use_flash_attn=True`` models, each step's attention is ``flash_attn_with_kvcache`` (rotary and
the cache append fused into it where the rotary dimension allows).

``cg=True`` (as flash-attn's): the first call (per model, batch size and decoding length) makes
the model's KV caches with ``model.allocate_inference_cache`` (sized for ``max_length``), then
captures one decoding step in a CUDA graph (``torch.cuda.CUDAGraph``, all graphs of a cache in
one memory pool) after ``n_warmups`` eager steps on a side stream; every later step copies the
token and its position into the graph's input tensors, writes the cached length of each row into
``inference_params.lengths_per_sample`` (int32, on the device) and replays the graph. Inside the
graph every per-step value comes from those tensors: the position embedding reads
``position_ids``, the rotary angles and the cache append position the per-row lengths
(``flash_attn_with_kvcache``'s ``cache_seqlens`` tensor). The prompt itself runs eagerly. The
graphs are kept in ``model._decoding_cache`` and captured again when the batch size or the
decoding length is new (a graph each), or all anew when ``max_length`` grows past the cache's,
the batch size past its largest, the device or the KV cache's dtype changes, or a tensor the
graphs read was replaced (parameters, buffers, rotary tables: ``model.to(...)``,
``load_state_dict(assign=True)``). A smaller ``max_length`` or batch size reuses the cache.
Call ``model.eval()`` first: in training mode a rotary model remakes its tables in every forward
(inference-mode tables), so each decode captures its graph again (correct, slow).

``EAGER_LENGTHS_TENSOR`` (default False, flash-attn's way): with True, ``cg=False`` keeps the
rows' cache lengths in ``lengths_per_sample`` too (filled before each step), so that
``flash_attn_with_kvcache`` runs every step on one launch plan instead of a plan per cache
length (an int ``cache_seqlens`` keys its plan); the same tokens and scores. In steady state the
plans per length are cached and the two run alike; the first run of new lengths is faster.

Differences from flash-attn: the outputs are this module's ``GreedySearchDecoderOnlyOutput`` /
``SampleDecoderOnlyOutput`` dataclasses (``sequences``, ``scores``; transformers is not needed);
``min_p`` applies with any ``top_k`` (flash-attn's only with ``top_k=0``); ``max_length`` must
exceed the prompt's length (flash-attn then returns one token past max_length) and the sampling
arguments are checked (``ValueError`` naming them). ``cg=True`` raises ``ValueError`` (naming
``cg``) where flash-attn fails later or decodes wrongly: a model whose parameters are not on a
CUDA device (CPU models: use ``cg=False``; flash-attn fails inside CUDA-graph calls), and a model
with an attention layer of ``use_flash_attn=False`` (its torch attention appends to the cache at
a host offset, which a graph would freeze at the captured step: flash-attn's graphs then decode
wrongly). As in flash-attn, all rows of a batch have the prompt's length (no per-row prompt
lengths)."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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


# decode(cg=False): the rows' cache lengths as an int32 tensor (inference_params.lengths_per_sample,
# filled before each step), so that flash_attn_with_kvcache runs every step on one launch plan
# (cache_seqlens a tensor); False: flash-attn's int seqlen_offset, an int cache_seqlens that keys
# (and builds) a plan per step.
EAGER_LENGTHS_TENSOR = False


@torch.inference_mode()
def decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0, repetition_penalty=1.0,
           eos_token_id=None, teacher_outputs=None, vocab_size=None, cg=False, enable_timing=False,
           output_scores=False, streamer=None):
    """flash-attn's ``decode``: tokens until each row has max_length tokens (prompt included) or
    every row's last token is eos_token_id. input_ids: (batch, seqlen) int, all rows the same
    length; model(input_ids, position_ids=..., inference_params=..., num_last_tokens=1) must
    return an object with ``logits`` (batch, 1, vocab). teacher_outputs (batch, n): where it has
    a token for a position, that token is taken instead of a sampled one. vocab_size: logits past
    it are dropped (a padded vocabulary). cg: each decoding step after the prompt replays a CUDA
    graph (see the module docstring; the model needs ``allocate_inference_cache`` and its
    parameters on a CUDA device). enable_timing: prints the prompt + decoding time (CUDA events
    for CUDA inputs). streamer: ``put`` gets the prompt then each new token (on the CPU), ``end``
    at the end. Returns GreedySearchDecoderOnlyOutput (top_k == 1) or SampleDecoderOnlyOutput."""
    _check_sampling(top_k, top_p, min_p, temperature)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    batch, prompt_len = input_ids.shape
    if not isinstance(max_length, int) or max_length <= prompt_len:
        raise ValueError(f"max_length must be an int larger than the prompt's length ({prompt_len}), got "
                         f"{max_length!r}")
    if repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
    if cg:
        model._decoding_cache = update_graph_cache(model, getattr(model, "_decoding_cache", None), batch,
                                                   prompt_len, max_length)
        params = model._decoding_cache.inference_params
        params.reset(max_length, batch)
    else:
        lengths = (torch.zeros(batch, dtype=torch.int32, device=input_ids.device) if EAGER_LENGTHS_TENSOR
                   else None)
        params = InferenceParams(max_seqlen=max_length, max_batch_size=batch, lengths_per_sample=lengths)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0
    timer = _Timer(input_ids.is_cuda) if enable_timing else None

    sequences, scores, history = [input_ids], [], input_ids
    while True:
        last = sequences[-1]
        if params.seqlen_offset > 0 and ((eos_token_id is not None and bool((last == eos_token_id).all()))
                                          or params.seqlen_offset >= max_length - 1):
            break
        if params.seqlen_offset == 0:      # the prompt, eagerly
            logits = model(last, position_ids=None, inference_params=params, num_last_tokens=1).logits[:, -1]
            # cg: the prompt's forward may remake a rotary table that the graphs read (training mode
            # remakes inference-mode tables): capture this batch's step again, after the prompt
            if cg and _watched_tensors(model) != model._decoding_cache._watched:
                _recapture(model, model._decoding_cache, [(batch, 1)])
        else:
            position_ids = torch.full((batch, last.shape[1]), params.seqlen_offset, dtype=torch.long,
                                      device=input_ids.device)
            if cg:
                logits = model._decoding_cache.run(last, position_ids, params.seqlen_offset)[:, -1]
            else:
                if params.lengths_per_sample is not None:
                    params.lengths_per_sample.fill_(params.seqlen_offset)
                logits = model(last, position_ids=position_ids, inference_params=params,
                               num_last_tokens=1).logits[:, -1]
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
    if timer is not None:
        print(f"Prompt processing + decoding time: {timer.elapsed_ms():.0f}ms")
    cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return cls(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


class _Timer:
    """Wall time from its making to elapsed_ms(): CUDA events on the current stream for CUDA
    work (as flash-attn times decode), else the host clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if not self.cuda:
            return (time.perf_counter() - self.t0) * 1000
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


# ---------------------------------------------------------------------------------------
# CUDA graphs of the decoding step (decode's cg=True)

@dataclass
class DecodingCGCache:
    """flash-attn's ``DecodingCGCache``: the graphs of one model's decoding step and what they
    read. max_batch_size, max_seqlen: the KV caches' size; device, dtype: the caches'; callables:
    (batch_size, decoding_seqlen) -> that graph's ``run(input_ids, position_ids, seqlen)``;
    mempool: the graphs' shared memory pool; inference_params: the InferenceParams the graphs
    read (its key_value_memory_dict and lengths_per_sample are the graphs' inputs); run:
    ``run(input_ids, position_ids, seqlen)`` dispatching on input_ids' (batch, seqlen)."""
    max_batch_size: int = 0
    max_seqlen: int = 0
    device: Any = None
    dtype: Any = None
    callables: dict = field(default_factory=dict)
    mempool: Any = None
    inference_params: Optional[InferenceParams] = None
    run: Optional[Callable] = None
    _watched: tuple = ()          # the addresses of the tensors the graphs read (_watched_tensors)
    _captures: dict = field(default_factory=dict)   # (batch, decoding_seqlen) -> n_warmups: to capture again


def _require_cuda(device) -> None:
    if device.type != "cuda":
        raise ValueError(f"cg=True: CUDA graphs need the model's parameters on a CUDA device, got {device}; "
                         "decode with cg=False on this device")


def _check_graphable(model) -> None:
    """cg=True's layers: an attention layer on the torch attention (use_flash_attn=False) appends
    to its cache at the host's seqlen_offset, which a graph would freeze."""
    for name, module in model.named_modules():
        if getattr(module, "use_flash_attn", True) is False and hasattr(module, "allocate_inference_cache"):
            raise ValueError(f"cg=True: layer {name or type(model).__name__} has use_flash_attn=False, whose "
                             "torch attention appends to the KV cache at a host offset that a CUDA graph would "
                             "freeze; use use_flash_attn=True (flash_attn_with_kvcache reads the lengths on the "
                             "device) or cg=False")


def _new_mempool():
    return torch.cuda.graphs.graph_pool_handle()


def _watched_tensors(model) -> tuple:
    """The addresses of what the captured graphs read besides their inputs: parameters, buffers
    and the rotary tables (plain attributes, remade when a longer or other-dtype table is
    needed). A changed address means the graphs read freed memory: capture again."""
    ptrs = [t.data_ptr() for t in model.parameters()] + [t.data_ptr() for t in model.buffers()]
    for module in model.modules():
        for name in ("_cos_cached", "_sin_cached", "_cos_k_cached", "_sin_k_cached"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor):
                ptrs.append(t.data_ptr())
    return tuple(ptrs)


def _recapture(model, cache, keys) -> None:
    """The graphs of ``keys`` ((batch, decoding_seqlen) pairs captured before) captured anew in a
    new pool, the cache's other graphs dropped (captured again when asked for): a tensor the
    graphs read has moved since they were captured."""
    captures = {key: cache._captures[key] for key in keys}
    offset = cache.inference_params.seqlen_offset
    cache.callables, cache._captures, cache.mempool = {}, {}, None
    gc.collect()
    cache.mempool = _new_mempool()
    for (batch_size, decoding_seqlen), n_warmups in captures.items():
        cache.callables[batch_size, decoding_seqlen] = capture_graph(
            model, cache.inference_params, batch_size, cache.max_seqlen, decoding_seqlen=decoding_seqlen,
            mempool=cache.mempool, n_warmups=n_warmups)
        cache._captures[batch_size, decoding_seqlen] = n_warmups
    cache.inference_params.seqlen_offset = offset
    cache._watched = _watched_tensors(model)


@torch.inference_mode()
def update_graph_cache(model, cache, batch_size, seqlen_og, max_seqlen, decoding_seqlens=(1,), dtype=None,
                       n_warmups=2):
    """flash-attn's ``update_graph_cache``: ``cache`` (a DecodingCGCache, or None for a new one)
    made ready for decoding batch_size rows of up to max_seqlen tokens, seqlen_og of them the
    prompt's: the KV caches (``model.allocate_inference_cache(batch_size, max_seqlen, dtype)``,
    dtype default the parameters') and the pool made anew when the device or dtype changes or
    batch_size / max_seqlen exceed the cache's (every graph dropped); a graph captured
    (``capture_graph``) for each decoding length in decoding_seqlens (tokens per step) not yet
    captured at this batch size. Returns the cache; its ``inference_params.seqlen_offset`` is 0."""
    if cache is None:
        cache = DecodingCGCache()
    param = next(iter(model.parameters()))
    device, dtype = param.device, param.dtype if dtype is None else dtype
    _require_cuda(device)
    _check_graphable(model)
    if not hasattr(model, "allocate_inference_cache"):
        raise ValueError(f"cg=True: CUDA-graph decoding needs the model's allocate_inference_cache(batch_size, "
                         f"max_seqlen, dtype) ({type(model).__name__} has none)")
    for name, value in (("batch_size", batch_size), ("seqlen_og", seqlen_og), ("max_seqlen", max_seqlen)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    seqlens = tuple(decoding_seqlens)
    if not seqlens or any(not isinstance(n, int) or n < 1 or n > max_seqlen for n in seqlens):
        raise ValueError(f"decoding_seqlens must be ints in [1, max_seqlen = {max_seqlen}], got {decoding_seqlens!r}")
    if ((device, dtype) != (cache.device, cache.dtype) or batch_size > cache.max_batch_size
            or max_seqlen > cache.max_seqlen):
        cache.callables, cache._captures, cache.mempool, cache.inference_params = {}, {}, None, None
        gc.collect()     # the old graphs and caches go before the new ones are made
        cache.device, cache.dtype = device, dtype
        cache.max_batch_size, cache.max_seqlen = batch_size, max_seqlen
        cache.inference_params = InferenceParams(
            max_seqlen=max_seqlen, max_batch_size=batch_size, seqlen_offset=seqlen_og,
            key_value_memory_dict=model.allocate_inference_cache(batch_size, max_seqlen, dtype),
            lengths_per_sample=torch.full((batch_size,), seqlen_og, dtype=torch.int32, device=device))
        cache.mempool = _new_mempool()
    elif cache.callables and _watched_tensors(model) != cache._watched:
        _recapture(model, cache, list(cache._captures))
    for decoding_seqlen in seqlens:
        if (batch_size, decoding_seqlen) not in cache.callables:
            cache.callables[batch_size, decoding_seqlen] = capture_graph(
                model, cache.inference_params, batch_size, cache.max_seqlen, decoding_seqlen=decoding_seqlen,
                mempool=cache.mempool, n_warmups=n_warmups)
            cache._captures[batch_size, decoding_seqlen] = n_warmups
    cache._watched = _watched_tensors(model)

    def dispatch(input_ids, position_ids, seqlen):
        graph = cache.callables.get(tuple(input_ids.shape[:2]))
        if graph is None:
            raise ValueError(f"input_ids: no CUDA graph for (batch, tokens) = {tuple(input_ids.shape[:2])} "
                             f"(captured: {sorted(cache.callables)}); call update_graph_cache with that batch size "
                             "and decoding_seqlens first")
        return graph(input_ids, position_ids, seqlen)

    cache.run = dispatch
    cache.inference_params.seqlen_offset = 0
    return cache


def _capture(step, mempool, n_warmups):
    """step() run n_warmups times on a side stream (first calls: cuflash's launch plans, the
    rotary tables, cuBLAS workspaces), then captured in a CUDA graph in mempool. Returns (replay,
    step's output: the tensor each replay writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n_warmups):
            step()
        side.synchronize()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        out = step()
    return graph.replay, out


def capture_graph(model, inference_params, batch_size, max_seqlen, decoding_seqlen=1, mempool=None, n_warmups=2):
    """flash-attn's ``capture_graph``: one decoding step of batch_size rows and decoding_seqlen
    tokens each captured in a CUDA graph (in mempool), after n_warmups eager steps. It runs with
    inference_params.seqlen_offset at max_seqlen - decoding_seqlen (so every kernel is sized for
    the longest cache), its positions and cache lengths from tensors: returns ``run(input_ids,
    position_ids, seqlen)``, which copies input_ids and position_ids (batch_size,
    decoding_seqlen) into the graph's inputs, sets inference_params.lengths_per_sample to seqlen
    (the tokens already cached, an int) and replays; it returns the logits (batch_size,
    decoding_seqlen, vocab), a new tensor (the graph's own is overwritten by the next replay).
    The warm-up steps write the last decoding_seqlen cache positions of the rows."""
    device = next(iter(model.parameters())).device
    if inference_params.lengths_per_sample is None:
        raise ValueError("inference_params.lengths_per_sample must be an int32 (max_batch_size,) tensor: the "
                         "graph reads the cached lengths from it")
    if max_seqlen < decoding_seqlen:
        raise ValueError(f"max_seqlen ({max_seqlen}) must be at least decoding_seqlen ({decoding_seqlen})")
    input_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    position_ids = torch.zeros((batch_size, decoding_seqlen), dtype=torch.long, device=device)
    offset = inference_params.seqlen_offset
    inference_params.seqlen_offset = max_seqlen - decoding_seqlen
    lengths = inference_params.lengths_per_sample
    lengths[:] = inference_params.seqlen_offset

    def step():
        return model(input_ids, position_ids=position_ids, inference_params=inference_params,
                     num_last_tokens=decoding_seqlen).logits

    try:
        replay, logits = _capture(step, mempool, n_warmups)
    finally:
        inference_params.seqlen_offset = offset

    def run(new_input_ids, new_position_ids, seqlen):
        lengths.fill_(seqlen)
        input_ids.copy_(new_input_ids)
        position_ids.copy_(new_position_ids)
        replay()
        return logits.clone()

    return run


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
