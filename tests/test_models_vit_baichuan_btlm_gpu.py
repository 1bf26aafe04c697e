"""cuflash.models.vit's VisionTransformer and the Baichuan / BTLM families on the GPU in bf16 with
use_flash_attn=True (cuflash's forward and backward kernels, head dim 64). The remaps and the
models' formulas are checked on the CPU (tests/test_models_vit_cpu.py,
tests/test_models_baichuan_btlm_cpu.py); here the error of the logits against the same weights
in float64 on the CPU must be within 2x that of the same model in bf16 with the plain torch
attention, the gradients' within 3x.

* ViT: 48 x 40 images, patch 8 (30 patches + the class token: 31 tokens), embed 256, 4 heads,
  depth 3; the last layer's class-token cross-attention (1 query over 31 keys) in the forward;
  with and without the fused dropout + add + LayerNorm; global_pool "avg" too. Reference: the
  float64 model on the CPU (torch attention). Also a training-mode step with dropout and drop
  path on (finite, and different from eval).
* Baichuan-7B-like (rotary), Baichuan-13B-like (ALiBi, 6 heads: non-power-of-two slopes) with
  Baichuan 2's normalized head, BTLM (ALiBi, SwiGLU, muP): causal, length 77. The float64
  reference runs cuflash's float64 CPU reference attention (ALiBi); the plain bf16 peer for the
  ALiBi models is a plain torch ALiBi attention (bf16 matmuls, softmax in bf16) written here,
  put in the same model's place of the inner attention (the torch attention of MHA has no
  ALiBi).
* ViT's init in bf16 on the GPU: no weight at the truncation bounds.
* Session 30: ViT with timm's LayerScale (init_values; the gammas' gradients too) and avgmax
  pooling; timm's jax / jax_nlhb / moco inits in bf16 on the GPU; Falcon-RW-like (ALiBi with the
  slopes over sqrt(head_dim), 6 heads) and BTLM with alibi_scaling (factor 2; train_seq_len 32 at
  length 77), each against float64 and its plain bf16 ALiBi peer; BTLM's dynamic alibi_scaling
  while decoding with the KV cache; MHA's alibi_train_seqlen on a packed batch.
* Session 31: timm's MAP head (global_pool="map": AttentionPoolLatent, the latent query over the
  patch tokens on cuflash's kernels; its latent, q, kv and MLP gradients too), without the class
  token (SigLIP) and with it + fc_norm + the fused LayerNorm, the pool's gradients also without
  check()'s absolute slack; the pool alone with latent_len 3 over 197 / 1029 tokens (peer: the same
  pool with the torch attention in bf16)."""
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from cuflash.models import baichuan, btlm, falcon  # noqa: E402
from cuflash.models.gpt import GPTLMHeadModel  # noqa: E402
from cuflash.models.vit import VisionTransformer  # noqa: E402
from cuflash.modules.mha import MHA  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

NS = types.SimpleNamespace


def max_err(got, ref):
    return (got.double().cpu() - ref.double().cpu()).abs().max().item()


def check(name, outs):
    """outs: {"ref" | "flash" | "plain": (logits, [grads])}; the 2x / 3x rules."""
    assert not outs["flash"][0].isnan().any()
    err, base = max_err(outs["flash"][0], outs["ref"][0]), max_err(outs["plain"][0], outs["ref"][0])
    print(f"{name}: logits error {err:.3e} (plain bf16 {base:.3e}, ratio {err / max(base, 1e-30):.2f})")
    assert err <= 2 * base + 1e-6, f"logits: {err:.3e} > 2 x plain {base:.3e}"
    for i, (g, r, b) in enumerate(zip(outs["flash"][1], outs["ref"][1], outs["plain"][1])):
        assert not g.isnan().any()
        gerr, gbase = max_err(g, r), max_err(b, r)
        print(f"{name}: grad {i} error {gerr:.3e} (plain bf16 {gbase:.3e}, ratio {gerr / max(gbase, 1e-30):.2f})")
        assert gerr <= 3 * gbase + 1e-6, f"grad {i}: {gerr:.3e} > 3 x plain {gbase:.3e}"


# ---------------------------------------------------------------------------------------
# ViT

VIT = dict(img_size=(48, 40), patch_size=8, in_chans=3, num_classes=10, embed_dim=256, depth=3, num_heads=4)


def vit(flash, dtype, device="cuda", state=None, **kw):
    torch.manual_seed(0)
    m = VisionTransformer(**VIT, use_flash_attn=flash, device=device, dtype=dtype, **kw)
    if state is not None:
        m.load_state_dict(state)
    return m


VIT_CASES = {"token_fused_ln": {}, "token": {}, "avg": dict(global_pool="avg"),
             # session 30: timm's LayerScale and avgmax pooling
             "token_fused_ln_layer_scale": dict(init_values=0.5), "avgmax_layer_scale": dict(global_pool="avgmax",
                                                                                          init_values=0.5),
             # session 31: timm's MAP head (a 1-query cross-attention over the patch tokens, cuflash's kernels)
             "map_no_cls": dict(global_pool="map", class_token=False),
             "map_fused_ln_cls_fc_norm": dict(global_pool="map", fc_norm=True)}


@pytest.mark.parametrize("case", list(VIT_CASES))
def test_vit_bf16_vs_float64(case):
    kw = VIT_CASES[case]
    ref = vit(False, torch.float64, device="cpu", **kw)
    with torch.no_grad():                         # non-trivial norms, biases and LayerScale gammas
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("gamma"):
                p.add_(torch.randn_like(p) * 0.2)
    state = ref.state_dict()
    flash = vit(True, torch.bfloat16, state=state, fused_dropout_add_ln="fused_ln" in case, **kw)
    plain = vit(False, torch.bfloat16, state=state, **kw)
    img = torch.randn(6, 3, 48, 40)
    labels = torch.randint(0, 10, (6,))
    last = "Wq" if kw.get("global_pool", "token") == "token" else "Wqkv"
    names = ["patch_embed.proj.weight", "blocks.0.mixer.Wqkv.weight", f"blocks.2.mixer.{last}.weight", "pos_embed"]
    if "init_values" in kw:
        names += ["blocks.1.ls1.gamma", "blocks.2.ls2.gamma"]
    if kw.get("global_pool") == "map":
        names += ["attn_pool.latent", "attn_pool.q.weight", "attn_pool.kv.weight", "attn_pool.mlp.fc1.weight"]
    outs = {}
    for key, m in (("ref", ref), ("flash", flash), ("plain", plain)):
        dev, dt = m.pos_embed.device, m.pos_embed.dtype
        logits = m.train()(img.to(dev, dt))            # drop rates 0: training mode = eval
        loss = F.cross_entropy(logits.float(), labels.to(dev))
        params = dict(m.named_parameters())
        outs[key] = (logits.detach(), torch.autograd.grad(loss, [params[n] for n in names]))
    check(f"vit {case}", outs)
    if kw.get("global_pool") == "map":     # the pool's gradients are ~1e-5: the 3x rule without check()'s 1e-6 slack
        for i in range(len(names) - 4, len(names)):
            ref_g = outs["ref"][1][i]
            gerr, gbase = max_err(outs["flash"][1][i], ref_g), max_err(outs["plain"][1][i], ref_g)
            assert gerr <= 3 * gbase, f"{names[i]}: {gerr:.3e} > 3 x plain {gbase:.3e}"
    feats = {k: m.eval().forward_features(img.to(m.pos_embed.device, m.pos_embed.dtype)).detach()
             for k, m in (("ref", ref), ("flash", flash), ("plain", plain))}
    err, base = max_err(feats["flash"], feats["ref"]), max_err(feats["plain"], feats["ref"])
    print(f"vit {case}: all-token features error {err:.3e} (plain bf16 {base:.3e})")
    assert err <= 2 * base + 1e-6


@pytest.mark.parametrize("tokens", [197, 1029])
def test_attention_pool_latent_bf16(tokens):
    """timm's AttentionPoolLatent alone, latent_len 3 (seqlen_q 3 over an odd token count, head dim
    64): bf16 on cuflash's kernels against float64 (the CPU reference), peer the torch-attention
    pool in bf16; output and the gradients of x, latent and kv."""
    from cuflash.models.vit import AttentionPoolLatent
    ln = lambda dim, **kw: torch.nn.LayerNorm(dim, eps=1e-6, **kw)      # noqa: E731
    torch.manual_seed(0)
    ref = AttentionPoolLatent(256, num_heads=4, latent_len=3, pool_type="", norm_layer=ln, use_flash_attn=True,
                              dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = ref.state_dict()
    mods = {"ref": ref}
    for key, flash in (("flash", True), ("plain", False)):
        mods[key] = AttentionPoolLatent(256, num_heads=4, latent_len=3, pool_type="", norm_layer=ln,
                                        use_flash_attn=flash, device="cuda", dtype=torch.bfloat16)
        mods[key].load_state_dict(state)
    x = torch.randn(5, tokens, 256, dtype=torch.float64)
    g = torch.randn(5, 3, 256, dtype=torch.float64)
    outs = {}
    for key, m in mods.items():
        dev, dt = m.latent.device, m.latent.dtype
        xi = x.to(dev, dt).requires_grad_(True)
        y = m(xi)
        grads = torch.autograd.grad((y.float() * g.to(dev).float()).sum(), [xi, m.latent, m.kv.weight])
        outs[key] = (y.detach(), grads)
    check(f"attention pool latent_len 3, {tokens} tokens", outs)


def test_vit_dropout_drop_path_training_step():
    m = vit(True, torch.bfloat16, drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.2, fused_dropout_add_ln=True)
    img = torch.randn(8, 3, 48, 40, device="cuda", dtype=torch.bfloat16)
    out = m.train()(img)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    with torch.no_grad():
        assert not torch.equal(out, m.eval()(img))


def test_vit_init_in_bf16_on_gpu():
    """The truncated-normal init drawn in bf16 on the GPU would put ±2 (100 standard deviations)
    into about 1 in 500 weights (round 1: ViT-B/16's initial loss 11.6 instead of about 7); drawn in
    fp32 and copied, every weight stays within a few standard deviations."""
    torch.manual_seed(0)
    m = VisionTransformer(**VIT, device="cuda", dtype=torch.bfloat16)
    for name, p in m.named_parameters():
        if p.dim() >= 2:
            assert p.abs().max().item() < 0.2, name
    assert abs(m.blocks[0].mixer.Wqkv.weight.float().std().item() - 0.02) < 0.002


@pytest.mark.parametrize("mode", ["jax", "jax_nlhb", "moco"])
def test_vit_weight_init_modes_bf16_on_gpu(mode):
    """timm's other init modes drawn on the GPU in bf16: finite, uniform weights within their
    bound (qkv: ±sqrt(6 / (4 D)) for jax, ±sqrt(6 / (2 D)) for moco), head zero for jax."""
    torch.manual_seed(0)
    m = VisionTransformer(**VIT, device="cuda", dtype=torch.bfloat16, weight_init=mode, init_values=1e-5)
    d = VIT["embed_dim"]
    bound = (6.0 / (4 * d)) ** 0.5 if mode.startswith("jax") else (6.0 / (2 * d)) ** 0.5
    for name in ("blocks.0.mixer.Wqkv.weight", "blocks.2.mixer.Wkv.weight"):
        w = dict(m.named_parameters())[name].float()
        assert torch.isfinite(w).all() and w.abs().max().item() <= bound * 1.004 and w.abs().max() > 0.9 * bound
    assert all(torch.isfinite(p.float()).all() for p in m.parameters())
    if mode.startswith("jax"):
        assert torch.count_nonzero(m.head.weight) == 0
    assert torch.equal(m.blocks[1].ls2.gamma.float(), torch.full((d,), 1e-5, device="cuda").bfloat16().float())


# ---------------------------------------------------------------------------------------
# Baichuan / BTLM

class PlainAlibiAttention(torch.nn.Module):
    """FlashSelfAttention's forward (packed qkv (batch, seqlen, 3, heads, head_dim)) in plain
    torch: scores in the input dtype, ALiBi bias -slope · (i - j), causal mask, softmax in the
    input dtype. BTLM's alibi_train_seqlen: the slopes divided by max(1, keys / it), keys = the
    sequence length, or per row max(prompt, i + 1) with prompt (KV-cache decoding's scales after a
    prompt of that many tokens, the whole sequence at once)."""

    def __init__(self, inner, prompt=None):
        super().__init__()
        self.slopes, self.scale, self.causal = inner.alibi_slopes.float(), inner.softmax_scale, inner.causal
        self.train_seqlen, self.prompt = getattr(inner, "alibi_train_seqlen", None), prompt

    def forward(self, qkv, causal=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        s = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) * (self.scale or q.shape[-1] ** -0.5)
        pos = torch.arange(s, device=q.device)
        keys = torch.full((s,), float(s), device=q.device)
        if self.prompt is not None:
            keys = torch.clamp(pos.float() + 1, min=float(self.prompt))
        row = torch.clamp(keys / self.train_seqlen, min=1.0) if self.train_seqlen else torch.ones_like(keys)
        bias = -(self.slopes[:, None, None] / row[None, :, None]) * (pos[:, None] - pos[None, :]).abs()
        scores = (scores + bias.to(scores.dtype)).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2)


V = 1000


def family_configs():
    return {
        "baichuan_7b_like": baichuan.baichuan_config_to_gpt2_config(NS(
            vocab_size=V, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
            hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.1)),
        "baichuan2_13b_like": baichuan.baichuan_config_to_gpt2_config(NS(
            vocab_size=V, hidden_size=384, intermediate_size=1000, num_hidden_layers=2, num_attention_heads=6,
            hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.1, use_alibi=True, norm_head=True)),
        "btlm": btlm.btlm_config_to_gpt2_config(NS(
            vocab_size=V, n_positions=128, n_embd=256, n_layer=2, n_head=4, n_inner=682, activation_function="swiglu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, initializer_range=0.1,
            position_embedding_type="alibi", mup_width_scale=0.5, mup_embeddings_scale=4.0, mup_output_alpha=1.5,
            mup_scale_qk_dot_by_d=True)),
        # session 30: Falcon-RW's ALiBi (slopes / sqrt(head_dim)) and BTLM's alibi_scaling (fixed, dynamic)
        "falcon_rw_like": falcon.falcon_config_to_gpt2_config(NS(
            vocab_size=V, hidden_size=384, num_hidden_layers=2, num_attention_heads=6, multi_query=False,
            new_decoder_architecture=False, parallel_attn=False, bias=True, alibi=True, layer_norm_epsilon=1e-5,
            hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.1)),
        "btlm_alibi_factor": btlm.btlm_config_to_gpt2_config(NS(**BTLM_SMALL, alibi_scaling={"type": "linear",
                                                                                               "factor": 2.0})),
        "btlm_alibi_train_seq_len": btlm.btlm_config_to_gpt2_config(NS(**BTLM_SMALL, alibi_scaling={
            "type": "linear", "train_seq_len": 32})),
    }


BTLM_SMALL = dict(vocab_size=V, n_positions=128, n_embd=256, n_layer=2, n_head=4, n_inner=682,
                  activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  layer_norm_epsilon=1e-5, initializer_range=0.1, position_embedding_type="alibi",
                  mup_width_scale=0.5, mup_embeddings_scale=4.0, mup_output_alpha=1.5, mup_scale_qk_dot_by_d=True)


def family_model(cfg, flash, dtype, device="cuda", state=None, plain_alibi=False, prompt=None):
    cfg.pad_vocab_size_multiple = 8
    cfg.use_flash_attn = flash
    torch.manual_seed(0)
    m = GPTLMHeadModel(cfg, device=device, dtype=dtype)
    if state is not None:
        m.load_state_dict(state)
    if plain_alibi:
        for layer in m.transformer.layers:
            layer.mixer.inner_attn = PlainAlibiAttention(layer.mixer.inner_attn, prompt)
    return m.eval()


@pytest.mark.parametrize("name", sorted(family_configs()))
def test_family_bf16_vs_float64(name):
    cfg = family_configs()[name]
    alibi = cfg.use_alibi
    ref = family_model(cfg, alibi, torch.float64, device="cpu")     # ALiBi: cuflash's float64 CPU reference
    state = ref.state_dict()
    flash = family_model(cfg, True, torch.bfloat16, state=state)
    plain = family_model(cfg, alibi, torch.bfloat16, state=state, plain_alibi=alibi)
    ids = torch.randint(0, V, (3, 77))
    labels = torch.randint(0, V, (3, 77))
    names = ["transformer.embeddings.word_embeddings.weight", "transformer.layers.1.mixer.Wqkv.weight"]
    outs = {}
    for key, m in (("ref", ref), ("flash", flash), ("plain", plain)):
        dev = next(m.parameters()).device
        logits = m(ids.to(dev)).logits[..., :V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(dev).flatten())
        params = dict(m.named_parameters())
        outs[key] = (logits.detach(), torch.autograd.grad(loss, [params[n] for n in names]))
    check(name, outs)


def test_btlm_alibi_train_seqlen_decoding():
    """BTLM's dynamic alibi_scaling while decoding with the KV cache (flash_attn_with_kvcache, the
    slopes divided by (cache + 1) / train_seq_len at each step once past it): prompt 20 tokens,
    then 24 steps (train_seq_len 32: the scale starts growing at step 12). The logits of the
    prompt and of every step against the float64 model decoding the same way on the CPU; the
    plain bf16 peer computes the whole sequence at once with each row's decoding scale."""
    cfg = family_configs()["btlm_alibi_train_seq_len"]
    ref = family_model(cfg, True, torch.float64, device="cpu")
    state = ref.state_dict()
    flash = family_model(cfg, True, torch.bfloat16, state=state)
    plain = family_model(cfg, True, torch.bfloat16, state=state, plain_alibi=True, prompt=20)
    ids = torch.randint(0, V, (3, 44))

    def decode(m):
        dev = next(m.parameters()).device
        params = InferenceParams(max_seqlen=44, max_batch_size=3)
        x = ids.to(dev)
        out = [m(x[:, :20], inference_params=params).logits[..., :V]]
        for t in range(20, 44):
            params.seqlen_offset = t
            out.append(m(x[:, t:t + 1], position_ids=torch.full((3, 1), t, device=dev),
                         inference_params=params).logits[..., :V])
        return torch.cat(out, dim=1).detach()

    with torch.no_grad():
        outs = {"ref": (decode(ref), []), "flash": (decode(flash), []),
                "plain": (plain(ids.cuda()).logits[..., :V].detach(), [])}
    check("btlm decode alibi train_seq_len", outs)


def test_mha_alibi_train_seqlen_packed():
    """MHA with alibi_train_seqlen on a packed batch (varlen kernel, (batch, nheads) slopes: each
    sequence its own scale) against each sequence alone in float64; peer: the plain bf16 ALiBi
    attention on each sequence alone."""
    torch.manual_seed(0)
    kw = dict(causal=True, use_alibi=True, use_flash_attn=True, alibi_train_seqlen=40, alibi_slope_scale=0.5)
    ref = MHA(256, 4, dtype=torch.float64, **kw).eval()
    state = ref.state_dict()
    flash = MHA(256, 4, device="cuda", dtype=torch.bfloat16, **kw).eval()
    flash.load_state_dict(state)
    plain = MHA(256, 4, device="cuda", dtype=torch.bfloat16, **kw).eval()
    plain.load_state_dict(state)
    plain.inner_attn = PlainAlibiAttention(plain.inner_attn)
    lens = [97, 23, 64, 41]
    xs = [torch.randn(1, n, 256, dtype=torch.float64) for n in lens]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    with torch.no_grad():
        want = torch.cat([ref(x)[0] for x in xs])
        got = flash(torch.cat([x[0] for x in xs]).cuda().bfloat16(), cu_seqlens=cu, max_seqlen=max(lens))
        peer = torch.cat([plain(x.cuda().bfloat16())[0] for x in xs])
    check("mha alibi train_seqlen packed", {"ref": (want, []), "flash": (got, []), "plain": (peer, [])})
