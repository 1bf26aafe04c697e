"""flash-attn's other decoder families as cuflash.models.gpt.GPTLMHeadModel on the GPU in bf16 with
use_flash_attn=True (cuflash's causal forward and backward kernels, head dim 64, the rotary
kernel), each built from its ``*_config_to_gpt2_config`` of a small Hugging Face-style config
(SimpleNamespace): GPT-NeoX (partial half-split rotary, parallel residual), GPT-J (partial
interleaved rotary, tied-norm parallel block, lm_head bias), OPT (learned positions, post-norm
with project_in / project_out: the OPT-350m layout), Falcon-7B (multi-query, tied-norm parallel),
Falcon new architecture (GQA, two norms), BigCode (multi-query, learned positions). The
remaps are checked on the CPU (tests/test_models_families_cpu.py); here the logits' error
against the same weights in float64 on the CPU (torch attention) must be within 2x that of the
same model in bf16 with the plain torch attention, the gradients of the word embedding and
layer 1's Wqkv within 3x. Odd length 77: partial tiles."""
import types

import pytest

torch = pytest.importorskip("torch")

from cuflash.models import bigcode, falcon, gpt_neox, gptj, opt  # noqa: E402
from cuflash.models.gpt import GPTLMHeadModel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

V, D, H, L = 1000, 256, 4, 2
NS = types.SimpleNamespace


def configs():
    return {
        "gpt_neox": gpt_neox.gpt_neox_config_to_gpt2_config(NS(
            vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=512,
            hidden_act="gelu", rotary_pct=0.25, layer_norm_eps=1e-5, use_parallel_residual=True,
            tie_word_embeddings=False, initializer_range=0.1)),
        "gptj": gptj.gptj_config_to_gpt2_config(NS(
            vocab_size=V, n_embd=D, n_layer=L, n_head=H, rotary_dim=32, activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1)),
        "opt_350m_like": opt.opt_config_to_gpt2_config(NS(
            vocab_size=V, max_position_embeddings=128, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
            ffn_dim=512, activation_function="relu", dropout=0.0, attention_dropout=0.0, init_std=0.1,
            do_layer_norm_before=False, word_embed_proj_dim=128)),
        "falcon_7b_like": falcon.falcon_config_to_gpt2_config(NS(
            vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, multi_query=True,
            new_decoder_architecture=False, parallel_attn=True, bias=False, hidden_dropout=0.0,
            attention_dropout=0.0, initializer_range=0.1)),
        "falcon_new_arch": falcon.falcon_config_to_gpt2_config(NS(
            vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_kv_heads=2,
            new_decoder_architecture=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
            initializer_range=0.1)),
        "bigcode": bigcode.bigcode_config_to_gpt2_config(NS(
            vocab_size=V, n_positions=128, n_embd=D, n_layer=L, n_head=H, multi_query=True, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1)),
    }


def make(cfg, flash, dtype, device="cuda", state=None):
    cfg.use_flash_attn = flash
    cfg.pad_vocab_size_multiple = 8
    torch.manual_seed(0)
    m = GPTLMHeadModel(cfg, device=device, dtype=dtype)
    if state is not None:
        m.load_state_dict(state)
    return m.eval()


def max_err(got, ref):
    return (got.double().cpu() - ref.double().cpu()).abs().max().item()


@pytest.mark.parametrize("name", sorted(configs()))
def test_family_forward_and_grads_bf16_vs_float64(name):
    cfg = configs()[name]
    ref = make(cfg, False, torch.float64, device="cpu")
    state = ref.state_dict()
    flash = make(cfg, True, torch.bfloat16, state=state)
    plain = make(cfg, False, torch.bfloat16, state=state)
    ids = torch.randint(0, V, (3, 77))
    labels = torch.randint(0, V, (3, 77))
    outs = {}
    for key, m in (("ref", ref), ("flash", flash), ("plain", plain)):
        dev = next(m.parameters()).device
        logits = m(ids.to(dev)).logits[..., :V]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.to(dev).flatten())
        params = dict(m.named_parameters())
        names = ["transformer.embeddings.word_embeddings.weight", "transformer.layers.1.mixer.Wqkv.weight"]
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
