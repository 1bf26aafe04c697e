"""cuflash.models.gpt.GPTLMHeadModel on the GPU in bf16 with use_flash_attn=True (cuflash's forward
kernels, the rotary kernel, flash_attn_with_kvcache when decoding), two small configs (GPT-2: learned
positions, MHA, GELU; Llama-like: GQA, interleaved partial rotary (32 of 64: the fused decode
path), RMSNorm, SwiGLU), head dim 64.

* forward: the logits' error against the same weights in float64 on the CPU (torch attention)
  within 2x that of the same model in bf16 with the plain torch attention (use_flash_attn=False);
  the loss gradient of the word embedding and one Wqkv within 3x.
* generation: greedy ``generate`` (prompt through the kernels, then one flash_attn_with_kvcache
  step per token) against greedy decoding by full forwards without a cache (the same bf16 model):
  equal token for token, or, at the first difference, the two tokens' logits within bf16 rounding
  of each other in the no-cache forward (a near tie, reported); each step's scores within 2x the
  no-cache forward's error against float64.
"""
import pytest

torch = pytest.importorskip("torch")

from cuflash.models.gpt import GPT2Config, GPTLMHeadModel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

COMMON = dict(vocab_size=1000, pad_vocab_size_multiple=8, n_embd=256, n_layer=2, n_head=4, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1)
CONFIGS = {
    "gpt2": dict(n_positions=128),
    "llama_gqa_rotary": dict(n_positions=0, n_head_kv=2, rotary_emb_fraction=0.5, rotary_emb_interleaved=True,
                             rms_norm=True, activation_function="swiglu", n_inner=512, qkv_proj_bias=False,
                             out_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False, tie_word_embeddings=False),
}


def make(name, flash, dtype, device="cuda", state=None):
    torch.manual_seed(0)
    m = GPTLMHeadModel(GPT2Config(**COMMON, **CONFIGS[name], use_flash_attn=flash), device=device, dtype=dtype)
    if state is not None:
        m.load_state_dict(state)
    return m.eval()


def max_err(got, ref):
    return (got.double().cpu() - ref.double().cpu()).abs().max().item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_and_grads_bf16_vs_float64(name):
    ref = make(name, False, torch.float64, device="cpu")
    state = ref.state_dict()
    flash = make(name, True, torch.bfloat16, state=state)
    plain = make(name, False, torch.bfloat16, state=state)
    ids = torch.randint(0, 1000, (3, 77))                   # odd length: partial tiles
    labels = torch.randint(0, 1000, (3, 77))
    outs = {}
    for key, m in (("ref", ref), ("flash", flash), ("plain", plain)):
        dev = next(m.parameters()).device
        logits = m(ids.to(dev)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.to(dev).flatten())
        names = ["transformer.embeddings.word_embeddings.weight", "transformer.layers.1.mixer.Wqkv.weight"]
        params = dict(m.named_parameters())
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        outs[key] = (logits.detach(), grads)
    assert not outs["flash"][0].isnan().any()
    err, base = max_err(outs["flash"][0], outs["ref"][0]), max_err(outs["plain"][0], outs["ref"][0])
    print(f"{name}: logits error {err:.3e} (plain bf16 {base:.3e})")
    assert err <= 2 * base + 1e-6, f"logits: {err:.3e} > 2 x plain {base:.3e}"
    for i, (g, r, b) in enumerate(zip(outs["flash"][1], outs["ref"][1], outs["plain"][1])):
        gerr, gbase = max_err(g, r), max_err(b, r)
        print(f"{name}: grad {i} error {gerr:.3e} (plain bf16 {gbase:.3e})")
        assert gerr <= 3 * gbase + 1e-6, f"grad {i}: {gerr:.3e} > 3 x plain {gbase:.3e}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generate_kvcache_equals_nocache(name):
    model = make(name, True, torch.bfloat16)
    ref = make(name, False, torch.float64, device="cpu", state=model.state_dict())
    prompt_len, max_length = 9, 40
    prompt = torch.randint(0, 1000, (2, prompt_len), device="cuda")
    out = model.generate(prompt, max_length, return_dict_in_generate=True, output_scores=True)
    seq = out.sequences
    assert seq.shape == (2, max_length) and torch.equal(seq[:, :prompt_len], prompt)
    ids = prompt
    with torch.no_grad():
        while ids.shape[1] < max_length:
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        full = model(seq).logits                              # no cache, on the cached run's tokens
        want = ref(seq.cpu()).logits
    differ = (seq != ids).any(dim=0).nonzero()
    if len(differ):
        t = int(differ[0])
        with torch.no_grad():
            step_logits = model(seq[:, :t]).logits[:, -1].float()
        rows = torch.arange(2, device="cuda")
        gap = (step_logits[rows, ids[:, t]] - step_logits[rows, seq[:, t]]).abs().max().item()
        print(f"{name}: first difference at position {t}, logit gap {gap:.3e}")
        assert gap <= 2 * 2.0 ** -7 * step_logits.abs().max().item(), f"tokens differ at {t}, gap {gap:.3e}"
    else:
        print(f"{name}: {max_length - prompt_len} greedy tokens equal with and without the KV cache")
    worst = (0.0, 0.0, 0.0)
    for i, scores in enumerate(out.scores):
        pos = prompt_len - 1 + i
        err, base = max_err(scores, want[:, pos]), max_err(full[:, pos], want[:, pos])
        worst = max(worst, (err / base, err, base))
        assert err <= 2 * base + 1e-6, f"step {i}: scores error {err:.3e} > 2 x no-cache {base:.3e}"
    print(f"{name}: decode-step scores vs float64: worst error {worst[1]:.3e} = {worst[0]:.2f} x the no-cache "
          f"forward's {worst[2]:.3e}")
