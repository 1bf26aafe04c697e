"""decode(..., cg=True) on the GPU: the decoding step replayed from a CUDA graph, against the same
model decoding eagerly (cg=False) and against float64. The two small configs of
tests/test_models_gpt_gpu.py (GPT-2: learned positions, MHA, GELU; Llama-like: GQA, interleaved
partial rotary 32 of head dim 64 (the fused decode path), RMSNorm, SwiGLU), bf16 and fp16.

* greedy tokens with cg=True equal cg=False's token for token (or, at a first difference, the
  two tokens' logits within rounding of each other in the eager step: a near tie, reported);
  each graph step's scores within 2x the no-cache forward's error against float64 (the same
  weights on the CPU), and their difference to the eager step's scores printed.
* the graph cache: a smaller batch and max_length reuse the KV caches with one more graph, a
  larger batch makes new ones, weights loaded with assign=True (new parameter tensors) are
  captured again; every run's tokens equal the eager run's.
* a use_flash_attn=False model is refused with cg=True (ValueError naming cg).
"""
import pytest

torch = pytest.importorskip("torch")

from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402
from test_models_gpt_gpu import COMMON, CONFIGS  # noqa: E402 - the same two small models

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def make(name, flash, dtype, device="cuda", state=None, seed=0):
    torch.manual_seed(seed)
    m = GPTLMHeadModel(GPT2Config(**COMMON, **CONFIGS[name], use_flash_attn=flash), device=device, dtype=dtype)
    if state is not None:
        m.load_state_dict(state)
    return m.eval()


def max_err(got, ref):
    return (got.double().cpu() - ref.double().cpu()).abs().max().item()


def check_same_tokens(model, eager, graph, dtype_name, what):
    """graph's tokens == eager's, or the first difference is a near tie in the eager step."""
    differ = (graph != eager).any(dim=0).nonzero()
    if not len(differ):
        print(f"{what}: {eager.shape[1]} tokens x {eager.shape[0]} rows equal with and without CUDA graphs")
        return
    t = int(differ[0])
    with torch.no_grad():
        step = model(eager[:, :t]).logits[:, -1].float()
    rows = torch.arange(eager.shape[0], device=step.device)
    gap = (step[rows, eager[:, t]] - step[rows, graph[:, t]]).abs().max().item()
    print(f"{what}: first difference at position {t}, logit gap {gap:.3e}")
    assert gap <= 2 * EPS[dtype_name] * step.abs().max().item(), f"{what}: tokens differ at {t}, gap {gap:.3e}"


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cg_tokens_and_scores(name, dtype_name):
    model = make(name, True, DTYPES[dtype_name])
    ref = make(name, False, torch.float64, device="cpu", state=model.state_dict())
    prompt_len, max_length = 9, 40
    prompt = torch.randint(0, 1000, (3, prompt_len), device="cuda")
    eager = model.generate(prompt, max_length, return_dict_in_generate=True, output_scores=True)
    graph = model.generate(prompt, max_length, return_dict_in_generate=True, output_scores=True, cg=True)
    assert list(model._decoding_cache.callables) == [(3, 1)]
    seq = graph.sequences
    assert seq.shape == (3, max_length) and torch.equal(seq[:, :prompt_len], prompt)
    check_same_tokens(model, eager.sequences, seq, dtype_name, f"{name} {dtype_name}")
    with torch.no_grad():
        full = model(seq).logits                              # no cache, on the graph run's tokens
        want = ref(seq.cpu()).logits
    worst, vs_eager = (0.0, 0.0, 0.0), 0.0
    for i, scores in enumerate(graph.scores):
        pos = prompt_len - 1 + i
        err, base = max_err(scores, want[:, pos]), max_err(full[:, pos], want[:, pos])
        worst = max(worst, (err / base, err, base))
        assert not scores.isnan().any(), f"step {i}: NaN scores"
        assert err <= 2 * base + 1e-6, f"step {i}: scores error {err:.3e} > 2 x no-cache {base:.3e}"
        if torch.equal(seq[:, :pos + 1], eager.sequences[:, :pos + 1]):
            vs_eager = max(vs_eager, max_err(scores, eager.scores[i]))
    print(f"{name} {dtype_name}: graph step scores vs float64: worst {worst[1]:.3e} = {worst[0]:.2f} x the "
          f"no-cache forward's {worst[2]:.3e}; largest difference to the eager steps' scores {vs_eager:.3e}")


def test_cg_cache_reuse_recapture_and_new_weights():
    name, dtype_name = "llama_gqa_rotary", "bf16"
    model = make(name, True, DTYPES[dtype_name])
    runs = [(3, 40), (1, 30), (3, 24), (5, 40)]
    for batch, max_length in runs:
        prompt = torch.randint(0, 1000, (batch, 7), device="cuda")
        graph = model.generate(prompt, max_length, cg=True)
        cache = model._decoding_cache
        print(f"batch {batch} max_length {max_length}: cache {cache.max_batch_size} x {cache.max_seqlen}, graphs "
              f"{sorted(cache.callables)}")
        check_same_tokens(model, model.generate(prompt, max_length), graph, dtype_name, f"batch {batch}")
    assert (cache.max_batch_size, cache.max_seqlen) == (5, 40) and list(cache.callables) == [(5, 1)]
    kv = cache.inference_params.key_value_memory_dict
    other = make(name, True, DTYPES[dtype_name], seed=5)
    model.load_state_dict(other.state_dict(), assign=True)     # new parameter tensors: captured again
    prompt = torch.randint(0, 1000, (5, 7), device="cuda")
    graph = model.generate(prompt, 40, cg=True)
    assert model._decoding_cache.inference_params.key_value_memory_dict is kv
    check_same_tokens(model, other.generate(prompt, 40), graph, dtype_name, "new weights")
    assert torch.equal(graph, model.generate(prompt, 40, cg=True))   # a replay of the same graph


def test_cg_refuses_torch_attention():
    model = make("gpt2", False, torch.bfloat16)
    with pytest.raises(ValueError, match="cg=True: layer .* use_flash_attn=False"):
        model.generate(torch.randint(0, 1000, (1, 5), device="cuda"), 12, cg=True)
