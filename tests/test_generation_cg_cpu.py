"""cuflash.utils.generation's CUDA-graph decoding (decode(..., cg=True): DecodingCGCache,
update_graph_cache, capture_graph) without a GPU.

* cg=True refuses, naming cg, a model on the CPU and a model with a use_flash_attn=False layer
  (whose torch attention appends to the cache at a host offset a graph would freeze).
* The host logic with the graph emulated (``_capture`` replaced by one that runs the captured
  step eagerly at each replay, ``_new_mempool`` by None, the CUDA check off): capture_graph's step
  runs with seqlen_offset frozen at max_seqlen - 1 and reads the positions and per-row cache
  lengths from tensors, as the graph does, so tokens and scores equal cg=False's on float64 CPU
  models (GPT-2, GQA with fused rotary, interleaved partial rotary on the unfused path, a
  parallel block), with teacher forcing, vocab_size and eos; the cache's bookkeeping: a graph per
  batch size at one KV cache, invalidation when max_length / batch size grow or the dtype
  changes, re-capture when a parameter was replaced, dispatch errors, argument checks and
  flash-attn's signatures."""
import inspect

import pytest

torch = pytest.importorskip("torch")

from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402
from cuflash.utils import generation  # noqa: E402

F64 = torch.float64
TINY = dict(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, initializer_range=0.3)
CASES = {
    "gpt2": dict(),
    "gqa_rotary16_fused": dict(n_positions=0, n_head_kv=2, rotary_emb_fraction=1.0),
    "rotary8_interleaved_unfused": dict(rotary_emb_fraction=0.5, rotary_emb_interleaved=True),
    "parallel_block_gqa": dict(parallel_block=True, n_head_kv=1, rotary_emb_fraction=1.0),
}


def model(case="gpt2", flash=True, seed=1, dtype=F64):
    torch.manual_seed(seed)
    return GPTLMHeadModel(GPT2Config(**{**TINY, **CASES[case]}, use_flash_attn=flash), dtype=dtype).eval()


@pytest.fixture
def emulated(monkeypatch):
    """CUDA graphs emulated on the CPU: each replay runs the captured step eagerly into the
    captured output tensor. Returns the list of captures: (batch_size, decoding_seqlen, the
    seqlen_offset the step ran with)."""
    captures = []

    def fake_capture(step, mempool, n_warmups):
        params = next(c.cell_contents for c in step.__closure__
                      if isinstance(c.cell_contents, generation.InferenceParams))
        frozen = (params.seqlen_offset, params.max_seqlen)   # what a graph keeps of the host's values
        for _ in range(n_warmups):
            step()
        out = step()
        captures.append((*out.shape[:2], frozen[0]))

        def replay():
            now = (params.seqlen_offset, params.max_seqlen)
            params.seqlen_offset, params.max_seqlen = frozen
            try:
                out.copy_(step())
            finally:
                params.seqlen_offset, params.max_seqlen = now

        return replay, out

    monkeypatch.setattr(generation, "_capture", fake_capture)
    monkeypatch.setattr(generation, "_new_mempool", lambda: None)
    monkeypatch.setattr(generation, "_require_cuda", lambda device: None)
    return captures


def test_cg_refuses_cpu_models_and_torch_attention(monkeypatch):
    m = model()
    prompt = torch.randint(0, 97, (2, 5))
    with pytest.raises(ValueError, match=r"cg=True: CUDA graphs need .* CUDA device, got cpu"):
        m.generate(prompt, 9, cg=True)
    assert m.generate(prompt, 9, cg=False).shape == (2, 9)
    monkeypatch.setattr(generation, "_require_cuda", lambda device: None)
    with pytest.raises(ValueError, match=r"cg=True: layer transformer\.layers\.0\.mixer has use_flash_attn=False"):
        model(flash=False).generate(prompt, 9, cg=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_graph_equals_eager(case, emulated):
    m = model(case)
    prompt = torch.randint(0, 97, (3, 5))
    eager = m.generate(prompt, 14, return_dict_in_generate=True, output_scores=True)
    graph = m.generate(prompt, 14, return_dict_in_generate=True, output_scores=True, cg=True)
    assert emulated == [(3, 1, 14 - 1)]          # captured at max_seqlen - 1
    assert torch.equal(graph.sequences, eager.sequences)
    assert len(graph.scores) == len(eager.scores) == 9
    for i, (g, e) in enumerate(zip(graph.scores, eager.scores)):
        assert torch.allclose(g, e, atol=1e-10, rtol=1e-9), i
    cache = m._decoding_cache
    assert cache.max_seqlen == 14 and cache.inference_params.seqlen_offset == 14 - 1    # decode's last
    # again with a smaller batch and max_length: the same KV cache, one more graph
    kv = cache.inference_params.key_value_memory_dict
    small = prompt[:2, :4]
    assert torch.equal(m.generate(small, 10, cg=True), m.generate(small, 10))
    assert m._decoding_cache is cache and cache.inference_params.key_value_memory_dict is kv
    assert sorted(cache.callables) == [(2, 1), (3, 1)] and emulated == [(3, 1, 13), (2, 1, 13)]


def test_recapture_rules(emulated):
    m = model("gqa_rotary16_fused")
    prompt = torch.randint(0, 97, (2, 5))
    m.generate(prompt, 12, cg=True)
    cache = m._decoding_cache
    kv = cache.inference_params.key_value_memory_dict
    assert (cache.max_batch_size, cache.max_seqlen, cache.dtype) == (2, 12, F64)
    m.generate(prompt, 12, cg=True)                       # same call: nothing captured
    assert emulated == [(2, 1, 11)]
    m.generate(prompt, 16, cg=True)                       # longer: new caches, graphs captured again
    assert cache.max_seqlen == 16 and cache.inference_params.key_value_memory_dict is not kv
    assert emulated == [(2, 1, 11), (2, 1, 15)] and list(cache.callables) == [(2, 1)]
    m.generate(torch.randint(0, 97, (4, 5)), 16, cg=True)  # more rows: new caches
    assert cache.max_batch_size == 4 and list(cache.callables) == [(4, 1)]
    m.to(torch.float32)                                   # another dtype: new caches
    seq = m.generate(prompt, 12, cg=True)
    assert cache.dtype == torch.float32 and list(cache.callables) == [(2, 1)]
    assert cache.inference_params.key_value_memory_dict[0].dtype == torch.float32
    assert torch.equal(seq, m.generate(prompt, 12))
    # a parameter replaced (the graph would read freed memory): captured again, same caches
    kv, n = cache.inference_params.key_value_memory_dict, len(emulated)
    other = model("gqa_rotary16_fused", seed=7, dtype=torch.float32)
    m.load_state_dict(other.state_dict(), assign=True)
    seq = m.generate(prompt, 12, cg=True)
    assert len(emulated) == n + 1 and cache.inference_params.key_value_memory_dict is kv
    assert torch.equal(seq, m.generate(prompt, 12)) and torch.equal(seq, other.generate(prompt, 12))


def test_cg_options_teacher_vocab_eos_timing(emulated, capsys):
    m = GPTLMHeadModel(GPT2Config(**TINY, pad_vocab_size_multiple=8, use_flash_attn=True), dtype=F64).eval()
    prompt = torch.randint(0, 97, (2, 4))
    teacher = torch.randint(0, 97, (2, 8))
    seq = m.generate(prompt, 10, teacher_outputs=teacher, cg=True)
    assert torch.equal(seq[:, 4:8], teacher[:, 4:8]) and torch.equal(seq, m.generate(prompt, 10,
                                                                                  teacher_outputs=teacher))
    out = m.generate(prompt, 6, vocab_size=97, return_dict_in_generate=True, output_scores=True, cg=True,
                     enable_timing=True)
    assert all(s.shape == (2, 97) for s in out.scores)
    assert "Prompt processing + decoding time:" in capsys.readouterr().out
    first = m.generate(prompt, 5)[:, -1]
    if first[0] == first[1]:
        assert m.generate(prompt, 10, eos_token_id=int(first[0]), cg=True).shape == (2, 5)
    torch.manual_seed(3)
    a = m.generate(prompt, 10, top_k=3, temperature=0.7, cg=True)
    torch.manual_seed(3)
    assert torch.equal(a, m.generate(prompt, 10, top_k=3, temperature=0.7))


def test_update_graph_cache_and_dispatch(emulated):
    m = model("rotary8_interleaved_unfused")
    cache = generation.update_graph_cache(m, None, 3, 5, 12, decoding_seqlens=(1, 4))
    assert isinstance(cache, generation.DecodingCGCache) and sorted(cache.callables) == [(3, 1), (3, 4)]
    params = cache.inference_params
    assert params.seqlen_offset == 0 and params.lengths_per_sample.dtype == torch.int32
    assert sorted(params.key_value_memory_dict) == [0, 1]
    assert params.key_value_memory_dict[0].shape == (3, 12, 2, 4, 16)
    # a 4-token step through the graph = the eager model on the same cache contents
    prompt = torch.randint(0, 97, (3, 5))
    with torch.inference_mode():     # the cache's tensors are inference tensors (update_graph_cache's mode)
        params.reset(12, 3)
        m(prompt, inference_params=params, num_last_tokens=1)
        ref_params = generation.InferenceParams(max_seqlen=12, max_batch_size=3)
        m(prompt, inference_params=ref_params, num_last_tokens=1)
        ref_params.seqlen_offset = params.seqlen_offset = 5
        nxt = torch.randint(0, 97, (3, 4))
        pos = torch.arange(5, 9).expand(3, 4)
        got = cache.run(nxt, pos, 5)
        want = m(nxt, position_ids=pos, inference_params=ref_params, num_last_tokens=4).logits
        assert torch.allclose(got, want, atol=1e-10, rtol=1e-9)
        with pytest.raises(ValueError, match=r"input_ids: no CUDA graph for \(batch, tokens\) = \(2, 1\)"):
            cache.run(nxt[:2, :1], pos[:2, :1], 5)
    for kw, word in ((dict(batch_size=0), "batch_size"), (dict(max_seqlen=2.0), "max_seqlen"),
                     (dict(decoding_seqlens=(0,)), "decoding_seqlens"),
                     (dict(decoding_seqlens=()), "decoding_seqlens")):
        args = {**dict(batch_size=2, seqlen_og=3, max_seqlen=8), **kw}
        with pytest.raises(ValueError, match=word):
            generation.update_graph_cache(m, None, **args)
    params = generation.InferenceParams(max_seqlen=8, max_batch_size=2)
    with pytest.raises(ValueError, match="lengths_per_sample"):
        generation.capture_graph(m, params, 2, 8)


def test_flash_attn_signatures():
    want = {
        generation.update_graph_cache: ["model", "cache", "batch_size", "seqlen_og", "max_seqlen",
                                        ("decoding_seqlens", (1,)), ("dtype", None), ("n_warmups", 2)],
        generation.capture_graph: ["model", "inference_params", "batch_size", "max_seqlen", ("decoding_seqlen", 1),
                                   ("mempool", None), ("n_warmups", 2)],
        GPTLMHeadModel.allocate_inference_cache: ["self", "batch_size", "max_seqlen", ("dtype", None)],
    }
    for fn, spec in want.items():
        ps = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
              if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert ps == [(w, inspect.Parameter.empty) if isinstance(w, str) else w for w in spec], fn.__qualname__
    fields = list(generation.DecodingCGCache.__dataclass_fields__)
    assert fields[:8] == ["max_batch_size", "max_seqlen", "device", "dtype", "callables", "mempool",
                          "inference_params", "run"]


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("case", ["gqa_rotary16_fused", "rotary8_interleaved_unfused"])
def test_eager_lengths_tensor_switch(case, flash, monkeypatch):
    """decode(cg=False) with the cache lengths as a tensor (EAGER_LENGTHS_TENSOR) = with flash-attn's int offset."""
    m = model(case, flash=flash)
    prompt = torch.randint(0, 97, (3, 5))
    runs = []
    for on in (False, True):
        monkeypatch.setattr(generation, "EAGER_LENGTHS_TENSOR", on)
        runs.append(m.generate(prompt, 13, return_dict_in_generate=True, output_scores=True))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].scores, runs[1].scores):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-9)


def test_training_mode_rotary_recaptures_after_the_prompt(emulated):
    """In training mode the prompt's forward remakes the (inference-mode) rotary tables that the
    graph read: the step is captured again after the prompt, and the tokens stay eager's."""
    m = model("gqa_rotary16_fused").train()
    prompt = torch.randint(0, 97, (2, 5))
    seq = m.generate(prompt, 11, cg=True)
    assert [c[:2] for c in emulated] == [(2, 1), (2, 1)]
    assert torch.equal(seq, m.generate(prompt, 11))
