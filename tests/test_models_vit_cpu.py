"""cuflash.models.vit without a GPU: VisionTransformer (flash-attn's module tree) loaded from a
random timm-style state dict (patch Conv2d weight, ``blocks.{i}.attn.qkv`` / ``attn.proj``) must
give the logits and features of a plain-torch ViT written here from timm's formulas (conv patch
embedding, class token, position embedding, pre-norm blocks x + attn(norm1(x)), x + mlp(norm2(x)),
final norm, pooling, fc_norm, head), in float64, with cuflash's attention (its float64 reference
on the CPU, use_flash_attn=True) and the torch attention; for global_pool "token" / "avg" / "",
class_token off, no_embed_class, pre_norm, fc_norm, the fused dropout + add + LayerNorm path and
fused_mlp; timm's LayerScale (init_values: x + gamma · branch) and max / avgmax pooling; timm's
"map" attention pool (AttentionPoolLatent: a learned latent query, q / kv / proj, norm + MLP
residual; alone with latent_len 3 too) and pool_include_prefix; timm's
weight_init modes "jax", "jax_nlhb", "moco" (their distributions checked); gradients; the
flash-attn-layout round trip; loading from .safetensors files and directories; refused
arguments."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cuflash  # noqa: E402
from cuflash.layers.patch_embed import PatchEmbed  # noqa: E402
from cuflash.models._checkpoint import save_safetensors  # noqa: E402
from cuflash.models.vit import (AttentionPoolLatent, VisionTransformer, load_pretrained,  # noqa: E402
                                vit_base_patch16_224)

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-9)
IMG, P, C, D, H, DEPTH, NC = (24, 16), 8, 3, 32, 4, 3, 7     # 3 × 2 patches of 8 × 8, 4 heads of 8


def rnd(*shape, scale=0.3):
    return torch.randn(*shape, dtype=F64) * scale


def pool_state(prefix="attn_pool.", dim=D, inner=int(D * 2.0), latent_len=1, norm=True):
    """timm's AttentionPoolLatent keys, random values."""
    sd = {prefix + "latent": rnd(1, latent_len, dim), prefix + "q.weight": rnd(dim, dim), prefix + "q.bias": rnd(dim),
          prefix + "kv.weight": rnd(2 * dim, dim), prefix + "kv.bias": rnd(2 * dim),
          prefix + "proj.weight": rnd(dim, dim), prefix + "proj.bias": rnd(dim),
          prefix + "mlp.fc1.weight": rnd(inner, dim), prefix + "mlp.fc1.bias": rnd(inner),
          prefix + "mlp.fc2.weight": rnd(dim, inner), prefix + "mlp.fc2.bias": rnd(dim)}
    if norm:
        sd[prefix + "norm.weight"], sd[prefix + "norm.bias"] = 1 + rnd(dim), rnd(dim)
    return sd


def pool_ref(sd, x, heads=H, prefix="attn_pool.", pool="token", norm=True):
    """timm's AttentionPoolLatent forward, written out: the latent's queries over x's tokens,
    (batch, heads, latent_len, tokens) scores, proj, then y + mlp(norm(y)) and the pooling."""
    b, n, d = x.shape
    latent = sd[prefix + "latent"].expand(b, -1, -1)
    n_lat, hd = latent.shape[1], d // heads
    q = F.linear(latent, sd[prefix + "q.weight"], sd[prefix + "q.bias"]).reshape(b, n_lat, heads, hd).transpose(1, 2)
    k, v = F.linear(x, sd[prefix + "kv.weight"], sd[prefix + "kv.bias"]).reshape(b, n, 2, heads, hd).permute(
        2, 0, 3, 1, 4).unbind(0)
    a = ((q @ k.transpose(-1, -2)) * hd ** -0.5).softmax(-1) @ v
    y = F.linear(a.transpose(1, 2).reshape(b, n_lat, d), sd[prefix + "proj.weight"], sd[prefix + "proj.bias"])
    t = F.layer_norm(y, (d,), sd[prefix + "norm.weight"], sd[prefix + "norm.bias"], 1e-6) if norm else y
    y = y + F.linear(F.gelu(F.linear(t, sd[prefix + "mlp.fc1.weight"], sd[prefix + "mlp.fc1.bias"])),
                     sd[prefix + "mlp.fc2.weight"], sd[prefix + "mlp.fc2.bias"])
    if pool == "token":
        return y[:, 0]
    return y.mean(1) if pool == "avg" else y


def timm_state(class_token=True, no_embed_class=False, pre_norm=False, use_fc_norm=False, mlp_ratio=2.0,
               layer_scale=False, attn_pool=False):
    n_patches = (IMG[0] // P) * (IMG[1] // P)
    inner = int(D * mlp_ratio)
    sd = {"patch_embed.proj.weight": rnd(D, C, P, P, scale=0.1),
          "pos_embed": rnd(1, n_patches + (0 if no_embed_class or not class_token else 1), D),
          "head.weight": rnd(NC, D), "head.bias": rnd(NC)}
    if not pre_norm:
        sd["patch_embed.proj.bias"] = rnd(D)
    else:
        sd["norm_pre.weight"], sd["norm_pre.bias"] = 1 + rnd(D), rnd(D)
    if class_token:
        sd["cls_token"] = rnd(1, 1, D)
    final = "fc_norm." if use_fc_norm else "norm."
    sd[final + "weight"], sd[final + "bias"] = 1 + rnd(D), rnd(D)
    for i in range(DEPTH):
        p = f"blocks.{i}."
        sd.update({p + "norm1.weight": 1 + rnd(D), p + "norm1.bias": rnd(D), p + "norm2.weight": 1 + rnd(D),
                   p + "norm2.bias": rnd(D), p + "attn.qkv.weight": rnd(3 * D, D), p + "attn.qkv.bias": rnd(3 * D),
                   p + "attn.proj.weight": rnd(D, D), p + "attn.proj.bias": rnd(D), p + "mlp.fc1.weight": rnd(inner, D),
                   p + "mlp.fc1.bias": rnd(inner), p + "mlp.fc2.weight": rnd(D, inner), p + "mlp.fc2.bias": rnd(D)})
        if layer_scale:       # trained gammas: any per-channel values, not the init
            sd[p + "ls1.gamma"], sd[p + "ls2.gamma"] = rnd(D), rnd(D)
    if attn_pool:
        sd.update(pool_state(inner=inner))
    return sd


def ln(x, sd, prefix):
    return F.layer_norm(x, (D,), sd[prefix + "weight"], sd[prefix + "bias"], 1e-6)


def fp32(x):
    """The residual stream's rounding: flash-attn's ViT keeps it in fp32 (residual_in_fp32), so a
    float64 model rounds it to fp32 after each norm reads it."""
    return x.float().double()


def timm_ref(sd, img, global_pool="token", class_token=True, no_embed_class=False, pre_norm=False,
             use_fc_norm=False, tanh_gelu=False, features=False, include_prefix=False):
    """timm's VisionTransformer forward, written out (the residual stream rounded to fp32 where
    flash-attn's layout rounds it)."""
    x = F.conv2d(img, sd["patch_embed.proj.weight"], sd.get("patch_embed.proj.bias"), stride=P)
    x = x.flatten(2).transpose(1, 2)
    b = x.shape[0]
    if no_embed_class:
        x = x + sd["pos_embed"]
        if class_token:
            x = torch.cat([sd["cls_token"].expand(b, -1, -1), x], dim=1)
    else:
        if class_token:
            x = torch.cat([sd["cls_token"].expand(b, -1, -1), x], dim=1)
        x = x + sd["pos_embed"]
    if pre_norm:
        x = ln(x, sd, "norm_pre.")
    hd = D // H
    for i in range(DEPTH):
        p = f"blocks.{i}."
        t = ln(x, sd, p + "norm1.")
        x = fp32(x)
        q, k, v = F.linear(t, sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"]).unflatten(-1, (3, H, hd)).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        a = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).softmax(-1) @ v
        ls1, ls2 = sd.get(p + "ls1.gamma", 1.0), sd.get(p + "ls2.gamma", 1.0)     # LayerScale: x + gamma · branch
        x = x + ls1 * F.linear(a.transpose(1, 2).flatten(-2), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])
        t = ln(x, sd, p + "norm2.")
        x = fp32(x)
        t = F.gelu(F.linear(t, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"]),
                   approximate="tanh" if tanh_gelu else "none")
        x = x + ls2 * F.linear(t, sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"])
    if not use_fc_norm:
        x = ln(x, sd, "norm.")
    if features:
        return x
    npt = 0 if include_prefix or not class_token else 1
    if global_pool == "map":          # the MAP head's MLP: exact GELU (timm's act_layer), also with fused_mlp
        x = pool_ref(sd, x[:, npt:])
    elif global_pool == "avg":
        x = x[:, npt:].mean(1)
    elif global_pool == "max":
        x = x[:, npt:].max(1).values
    elif global_pool == "avgmax":
        x = (x[:, npt:].max(1).values + x[:, npt:].mean(1)) / 2
    elif global_pool == "token":
        x = x[:, 0]
    if use_fc_norm:
        x = ln(x, sd, "fc_norm.")
    return F.linear(x, sd["head.weight"], sd["head.bias"])


def make(flash=True, **kw):
    return VisionTransformer(img_size=IMG, patch_size=P, in_chans=C, num_classes=NC, embed_dim=D, depth=DEPTH,
                             num_heads=H, mlp_ratio=2.0, use_flash_attn=flash, dtype=F64, **kw)


CASES = {
    "token": dict(),
    "avg_fc_norm": dict(global_pool="avg"),
    "none_no_cls_no_embed_class_pre_norm": dict(global_pool="", class_token=False, no_embed_class=True, pre_norm=True),
    "token_no_embed_class_fc_norm": dict(no_embed_class=True, fc_norm=True),
    "avg_no_fc_norm": dict(global_pool="avg", fc_norm=False),
    "token_fused_ln": dict(fused_dropout_add_ln=True),
    "token_fused_mlp_bias_fc": dict(fused_mlp=True, fused_bias_fc=True),
    "token_layer_scale": dict(init_values=1e-5),
    "avgmax_layer_scale_fused_ln": dict(global_pool="avgmax", init_values=0.1, fused_dropout_add_ln=True),
    "max_no_cls_layer_scale": dict(global_pool="max", class_token=False, init_values=1.0),
    # session 31: timm's MAP head (SigLIP: no class token), with the class token left out or included
    "map_no_cls": dict(global_pool="map", class_token=False),
    "map_cls": dict(global_pool="map"),
    "map_cls_include_prefix_fc_norm_fused_ln": dict(global_pool="map", pool_include_prefix=True, fc_norm=True,
                                                    fused_dropout_add_ln=True),
    "map_layer_scale_no_embed_class_fused_mlp": dict(global_pool="map", init_values=0.1, no_embed_class=True,
                                                     fused_mlp=True),
    "avg_include_prefix": dict(global_pool="avg", pool_include_prefix=True),
}


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_vit_matches_timm_formulas(case, flash):
    kw = CASES[case]
    pool = kw.get("global_pool", "token")
    use_fc_norm = pool in ("avg", "max", "avgmax") if kw.get("fc_norm") is None else kw["fc_norm"]
    shape = dict(class_token=kw.get("class_token", True), no_embed_class=kw.get("no_embed_class", False),
                 pre_norm=kw.get("pre_norm", False))
    sd = timm_state(use_fc_norm=use_fc_norm, layer_scale="init_values" in kw, attn_pool=pool == "map", **shape)
    m = make(flash, **kw)
    m.load_state_dict(sd)
    m.eval()
    img = rnd(5, C, *IMG, scale=1.0)
    want = timm_ref(sd, img, pool, use_fc_norm=use_fc_norm, tanh_gelu=kw.get("fused_mlp", False),
                    include_prefix=kw.get("pool_include_prefix", False), **shape)
    got = m(img)
    assert got.shape == want.shape
    assert torch.allclose(got, want, **TOL), (got - want).abs().max()
    feats = m.forward_features(img, all_tokens=True)
    want_feats = timm_ref(sd, img, pool, use_fc_norm=use_fc_norm, tanh_gelu=kw.get("fused_mlp", False),
                          features=True, **shape)
    assert torch.allclose(feats, want_feats, **TOL)
    if pool == "token":      # the last layer on the class token only
        assert m.blocks[-1].mixer.cross_attn
        assert m.forward_features(img, all_tokens=False).shape == (5, 1, D)


@pytest.mark.parametrize("layer_scale", [False, True], ids=["plain", "layer_scale"])
def test_vit_gradients_and_training_mode(layer_scale):
    """fp64 gradients of the cuflash model equal the reference's (autograd through both), and
    with drop rates 0 the training-mode forward equals the eval one."""
    sd = timm_state(layer_scale=layer_scale)
    m = make(True, drop_path_rate=0.0, init_values=1e-5 if layer_scale else None)
    m.load_state_dict(sd)
    img = rnd(3, C, *IMG, scale=1.0)
    target = rnd(3, NC)
    loss = ((m.train()(img) - target) ** 2).sum()
    loss.backward()
    ref_sd = {k: v.clone().requires_grad_(True) for k, v in sd.items()}
    ((timm_ref(ref_sd, img) - target) ** 2).sum().backward()
    pairs = {"patch_embed.proj.weight": m.patch_embed.proj.weight.grad.reshape(D, C, P, P),
             "blocks.0.attn.qkv.weight": m.blocks[0].mixer.Wqkv.weight.grad,
             "blocks.2.attn.qkv.weight": torch.cat([m.blocks[2].mixer.Wq.weight.grad,
                                                    m.blocks[2].mixer.Wkv.weight.grad]),
             "pos_embed": m.pos_embed.grad, "cls_token": m.cls_token.grad, "head.weight": m.head.weight.grad}
    if layer_scale:
        pairs.update({"blocks.0.ls1.gamma": m.blocks[0].ls1.gamma.grad, "blocks.2.ls2.gamma": m.blocks[2].ls2.gamma.grad})
    for key, got in pairs.items():
        assert torch.allclose(got, ref_sd[key].grad, atol=1e-9, rtol=1e-8), key


def test_vit_state_dict_round_trip_and_files(tmp_path):
    sd = timm_state()
    m = make(True).eval()
    m.load_state_dict(sd)
    ours = m.state_dict()
    assert "blocks.2.mixer.Wq.weight" in ours and "blocks.0.mixer.Wqkv.weight" in ours
    assert ours["patch_embed.proj.weight"].shape == (D, C * P * P)
    assert set(sd) == {k for k in sd}                     # the given dict is not modified
    assert "blocks.0.attn.qkv.weight" in sd and sd["patch_embed.proj.weight"].dim() == 4
    img = rnd(2, C, *IMG, scale=1.0)
    want = m(img)
    again = make(False).eval()
    again.load_state_dict(ours)
    assert torch.allclose(again(img), want, **TOL)
    # a .safetensors file (timm keys) and a directory holding one
    save_safetensors(sd, tmp_path / "vit.safetensors")
    from_file = load_pretrained(make(True).eval(), tmp_path / "vit.safetensors")
    assert torch.equal(from_file(img), want)
    (tmp_path / "dir").mkdir()
    save_safetensors(sd, tmp_path / "dir" / "model.safetensors")
    assert torch.equal(load_pretrained(make(True).eval(), str(tmp_path / "dir"))(img), want)
    torch.save({"state_dict": sd}, tmp_path / "ckpt.pth")
    assert torch.equal(load_pretrained(make(True).eval(), tmp_path / "ckpt.pth")(img), want)


def test_vit_base_patch16_224(monkeypatch, tmp_path):
    m = vit_base_patch16_224(device="meta")
    assert sum(p.numel() for p in m.parameters()) == 86_567_656       # timm's ViT-B/16 count
    assert m.patch_embed.num_patches == 196 and m.pos_embed.shape == (1, 197, 768)
    assert len(m.blocks) == 12 and m.blocks[0].mixer.num_heads == 12
    with pytest.raises(cuflash.UnsupportedFeature, match="timm"):
        vit_base_patch16_224(pretrained=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")             # a hub name: the (empty) cache only, no network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    with pytest.raises(OSError, match="google/vit-base-patch16-224.*HF_HUB_OFFLINE"):
        vit_base_patch16_224(pretrained="google/vit-base-patch16-224", device="meta")


def test_patch_embed_equals_conv():
    pe = PatchEmbed(img_size=IMG, patch_size=P, in_chans=C, embed_dim=D, dtype=F64)
    img = rnd(2, C, *IMG)
    conv = F.conv2d(img, pe.proj.weight.reshape(D, C, P, P), pe.proj.bias, stride=P).flatten(2).transpose(1, 2)
    assert torch.allclose(pe(img), conv, **TOL)
    grid = PatchEmbed(img_size=IMG, patch_size=P, in_chans=C, embed_dim=D, flatten=False, dtype=F64)(img)
    assert grid.shape == (2, 3, 2, D)
    with pytest.raises(ValueError, match="24, 16"):
        pe(rnd(2, C, 16, 16))
    with pytest.raises(ValueError, match="multiple of patch_size"):
        PatchEmbed(img_size=20, patch_size=8)


def _bound_ok(w, bound):
    """w uniform in ±bound: inside it and reaching near both ends."""
    return w.abs().max() <= bound and w.max() > 0.9 * bound and w.min() < -0.9 * bound


WD, WH = 64, 4         # the init tests' width (enough weights for the statistics)


def make_wide(weight_init, global_pool="token", dtype=torch.float32, init_values=None, num_classes=NC):
    return VisionTransformer(img_size=(32, 32), patch_size=P, in_chans=C, num_classes=num_classes, embed_dim=WD,
                             depth=2, num_heads=WH, mlp_ratio=4.0, weight_init=weight_init, global_pool=global_pool,
                             init_values=init_values, dtype=dtype)


@pytest.mark.parametrize("mode", ["jax", "jax_nlhb"])
def test_vit_weight_init_jax(mode):
    """timm's init_weights_vit_jax: head zero (bias -log(classes) with nlhb), patch projection
    lecun normal (truncated at ±2 std), qkv xavier uniform as one (3D, D) matrix also when split
    into Wq / Wkv, other weights xavier uniform, MLP biases N(0, 1e-6²), other biases zero."""
    torch.manual_seed(0)
    m = make_wide(mode)
    assert torch.count_nonzero(m.head.weight) == 0
    assert torch.allclose(m.head.bias, torch.full((NC,), -math.log(NC) if mode == "jax_nlhb" else 0.0))
    fan_in = C * P * P
    w = m.patch_embed.proj.weight
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    assert w.abs().max() <= 2 * std + 1e-7 and abs(w.std().item() - math.sqrt(1.0 / fan_in)) < 0.1 / math.sqrt(fan_in)
    assert torch.count_nonzero(m.patch_embed.proj.bias) == 0
    qkv_bound = math.sqrt(6.0 / (WD + 3 * WD))
    assert _bound_ok(m.blocks[0].mixer.Wqkv.weight, qkv_bound)
    assert _bound_ok(m.blocks[1].mixer.Wq.weight, qkv_bound) and _bound_ok(m.blocks[1].mixer.Wkv.weight, qkv_bound)
    assert _bound_ok(m.blocks[0].mixer.out_proj.weight, math.sqrt(6.0 / (2 * WD)))
    assert _bound_ok(m.blocks[0].mlp.fc1.weight, math.sqrt(6.0 / (5 * WD)))
    for b in (m.blocks[0].mixer.Wqkv.bias, m.blocks[0].mixer.out_proj.bias, m.blocks[1].mixer.Wkv.bias):
        assert torch.count_nonzero(b) == 0
    mlp_bias = torch.cat([m.blocks[0].mlp.fc1.bias, m.blocks[1].mlp.fc2.bias])
    assert 0 < mlp_bias.abs().max() < 1e-5 and 0.5e-6 < mlp_bias.std() < 2e-6
    assert abs(m.pos_embed.std().item() - 0.02) < 0.004      # trunc_normal_'s bounds are ±2 (absolute): unused


def test_vit_weight_init_moco_and_layer_scale():
    """timm's init_weights_vit_moco: qkv uniform ±sqrt(6 / (D + D)) (Q, K, V each as its own
    matrix, also where split into Wq / Wkv), other linear weights xavier uniform, biases zero, the
    patch projection torch's default (timm's Conv2d untouched: ±1 / sqrt(fan_in)); LayerScale's
    gammas stay init_values; the default init still truncated normal std 0.02."""
    torch.manual_seed(0)
    m = make_wide("moco", init_values=0.25)
    qkv_bound = math.sqrt(6.0 / (2 * WD))
    assert _bound_ok(m.blocks[0].mixer.Wqkv.weight, qkv_bound)
    assert _bound_ok(m.blocks[1].mixer.Wq.weight, qkv_bound) and _bound_ok(m.blocks[1].mixer.Wkv.weight, qkv_bound)
    assert _bound_ok(m.blocks[0].mlp.fc2.weight, math.sqrt(6.0 / (5 * WD)))
    assert _bound_ok(m.head.weight, math.sqrt(6.0 / (WD + NC)))
    for b in (m.blocks[0].mixer.Wqkv.bias, m.blocks[0].mlp.fc1.bias, m.head.bias):
        assert torch.count_nonzero(b) == 0
    fan_in = C * P * P
    assert _bound_ok(m.patch_embed.proj.weight, 1 / math.sqrt(fan_in))
    assert m.patch_embed.proj.bias.abs().max() <= 1 / math.sqrt(fan_in)
    for blk in m.blocks:
        assert torch.equal(blk.ls1.gamma, torch.full((WD,), 0.25)) and torch.equal(blk.ls2.gamma, blk.ls1.gamma)
    assert "blocks.0.ls1.gamma" in m.state_dict()
    d = make_wide("", init_values=0.0)            # timm: init_values 0 → no LayerScale
    assert not hasattr(d.blocks[0], "ls1")
    assert abs(d.blocks[0].mixer.Wqkv.weight.std().item() - 0.02) < 0.004 and torch.count_nonzero(d.head.bias) == 0


@pytest.mark.parametrize("mode", ["", "jax", "moco"])
def test_vit_weight_init_bf16(mode):
    """bf16 parameters: every mode draws in fp32 and rounds (no ±inf / clamped outliers)."""
    torch.manual_seed(0)
    m = make_wide(mode, dtype=torch.bfloat16, init_values=1e-5)
    for name, p in m.named_parameters():
        assert torch.isfinite(p.float()).all(), name
        if p.dim() == 2 and "head" not in name:
            assert p.float().abs().max() < 0.5, name
    assert m.blocks[0].ls1.gamma.dtype == torch.bfloat16


def test_vit_refused():
    with pytest.raises(ValueError, match="init_values"):
        make(init_values="1e-5")
    with pytest.raises(ValueError, match="weight_init"):
        make(weight_init="xavier")
    with pytest.raises(ValueError, match="weight_init"):
        make().init_weights("jax_moco")
    with pytest.raises(ValueError, match="global_pool"):
        make(global_pool="prr")
    with pytest.raises(ValueError, match="class_token"):
        make(class_token=False)
    with pytest.raises(ValueError, match="num_heads"):
        VisionTransformer(embed_dim=30, num_heads=4, depth=1, device="meta")
    with pytest.raises(ValueError, match="state_dict"):
        make().load_state_dict([1, 2])


# ---------------------------------------------------------------------------------------
# timm's MAP head (session 31)

def test_vit_map_gradients():
    """fp64 gradients through the MAP head (latent, q, kv, proj, norm, MLP) and the blocks under
    it equal the written-out timm model's; the class token is left out of the pool but still
    reaches it through the blocks' attention."""
    sd = timm_state(attn_pool=True)
    m = make(True, global_pool="map")
    m.load_state_dict(sd)
    assert m.attn_pool.use_flash_attn and not m.blocks[-1].mixer.cross_attn
    img = rnd(3, C, *IMG, scale=1.0)
    target = rnd(3, NC)
    ((m.train()(img) - target) ** 2).sum().backward()
    ref_sd = {k: v.clone().requires_grad_(True) for k, v in sd.items()}
    ((timm_ref(ref_sd, img, "map") - target) ** 2).sum().backward()
    params = dict(m.named_parameters())
    for key in ("attn_pool.latent", "attn_pool.q.weight", "attn_pool.kv.weight", "attn_pool.kv.bias",
                "attn_pool.proj.weight", "attn_pool.norm.weight", "attn_pool.mlp.fc1.weight", "norm.weight",
                "cls_token", "pos_embed"):
        assert torch.allclose(params[key].grad, ref_sd[key].grad, atol=1e-9, rtol=1e-8), key
    assert torch.allclose(m.blocks[2].mixer.Wqkv.weight.grad, ref_sd["blocks.2.attn.qkv.weight"].grad, atol=1e-9,
                          rtol=1e-8)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "torch"])
@pytest.mark.parametrize("pool,norm", [("", True), ("avg", False), ("token", True)])
def test_attention_pool_latent_alone(pool, norm, flash):
    """AttentionPoolLatent with latent_len 3 (seqlen_q 3 over 13 tokens, 4 heads of 8) against the
    written-out pool in float64, forward and gradients; no norm (timm's norm_layer=None) too."""
    m = AttentionPoolLatent(D, num_heads=H, mlp_ratio=2.0, latent_len=3, pool_type=pool,
                            norm_layer=partial_ln() if norm else None, use_flash_attn=flash, dtype=F64)
    sd = pool_state(prefix="", latent_len=3, norm=norm)
    m.load_state_dict(sd)
    assert set(m.state_dict()) == set(sd)
    x = rnd(2, 13, D, scale=1.0).requires_grad_(True)
    got = m(x)
    xr = x.detach().clone().requires_grad_(True)
    ref_sd = {k: v.clone().requires_grad_(True) for k, v in sd.items()}
    want = pool_ref(ref_sd, xr, prefix="", pool=pool, norm=norm)
    assert got.shape == want.shape == ((2, 3, D) if pool == "" else (2, D))
    assert torch.allclose(got, want, **TOL)
    g = rnd(*got.shape)
    (got * g).sum().backward()
    (want * g).sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-9, rtol=1e-8)
    for key, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_sd[key].grad, atol=1e-9, rtol=1e-8), key


def partial_ln():
    return lambda dim, **kw: torch.nn.LayerNorm(dim, eps=1e-6, **kw)


def test_vit_map_state_dict_round_trip_and_files(tmp_path):
    """A timm MAP checkpoint (SigLIP-style: no class token) loads as it is, from a dict and a
    .safetensors file; the model's own state dict keeps timm's attn_pool keys and loads into the
    torch-attention model with the same logits."""
    sd = timm_state(class_token=False, attn_pool=True)
    m = make(True, global_pool="map", class_token=False).eval()
    m.load_state_dict(sd)
    ours = m.state_dict()
    assert {k for k in ours if k.startswith("attn_pool.")} == {k for k in sd if k.startswith("attn_pool.")}
    assert ours["attn_pool.latent"].shape == (1, 1, D) and ours["attn_pool.kv.weight"].shape == (2 * D, D)
    img = rnd(2, C, *IMG, scale=1.0)
    want = m(img)
    again = make(False, global_pool="map", class_token=False).eval()
    again.load_state_dict(ours)
    assert torch.allclose(again(img), want, **TOL)
    save_safetensors(sd, tmp_path / "map.safetensors")
    assert torch.equal(load_pretrained(make(True, global_pool="map", class_token=False).eval(),
                                       tmp_path / "map.safetensors")(img), want)
    assert m.forward_head(m.forward_features(img), pre_logits=True).shape == (2, D)
    with pytest.raises(RuntimeError, match="attn_pool"):        # a checkpoint without the pool: strict load
        make(True, global_pool="map", class_token=False).load_state_dict(timm_state(class_token=False))


def test_vit_map_init():
    """timm's inits reach the MAP head: its linear layers as every other (""; "jax": xavier
    uniform, MLP biases N(0, 1e-6²), others zero; "moco": xavier, kv not treated as qkv), the
    latent truncated normal, std embed_dim^-0.5, within ±2 std, in every mode; bf16 drawn in fp32."""
    torch.manual_seed(0)
    std = WD ** -0.5
    for mode in ("", "jax", "moco"):
        m = make_wide(mode, global_pool="map")
        lat = m.attn_pool.latent
        assert lat.shape == (1, 1, WD) and lat.abs().max() <= 2 * std + 1e-7 and 0.5 * std < lat.std() < 1.5 * std
        pool = m.attn_pool
        if mode == "":
            assert abs(pool.kv.weight.std().item() - 0.02) < 0.004 and torch.count_nonzero(pool.mlp.fc1.bias) == 0
        elif mode == "jax":
            assert _bound_ok(pool.q.weight, math.sqrt(6.0 / (2 * WD)))
            assert _bound_ok(pool.kv.weight, math.sqrt(6.0 / (3 * WD)))
            assert _bound_ok(pool.mlp.fc1.weight, math.sqrt(6.0 / (5 * WD)))
            mlp_bias = torch.cat([pool.mlp.fc1.bias, pool.mlp.fc2.bias])
            assert 0 < mlp_bias.abs().max() < 1e-5
            for b in (pool.q.bias, pool.kv.bias, pool.proj.bias):
                assert torch.count_nonzero(b) == 0
        else:
            assert _bound_ok(pool.kv.weight, math.sqrt(6.0 / (3 * WD)))
            assert torch.count_nonzero(pool.kv.bias) == 0
    m = make_wide("", global_pool="map", dtype=torch.bfloat16)
    assert torch.isfinite(m.attn_pool.latent.float()).all() and m.attn_pool.latent.float().abs().max() <= 2 * std


def test_attention_pool_refused():
    with pytest.raises(ValueError, match="num_heads"):
        AttentionPoolLatent(30, num_heads=4)
    with pytest.raises(ValueError, match="latent_len"):
        AttentionPoolLatent(32, num_heads=4, latent_len=0)
    with pytest.raises(ValueError, match="pool_type"):
        AttentionPoolLatent(32, num_heads=4, pool_type="max")
    with pytest.raises(ValueError, match="mlp_ratio"):
        AttentionPoolLatent(32, num_heads=4, mlp_ratio=0.0)
    with pytest.raises(ValueError, match="dim"):
        AttentionPoolLatent(32.0, num_heads=4)
    pool = AttentionPoolLatent(32, num_heads=4, dtype=F64)
    with pytest.raises(ValueError, match="x must be"):
        pool(rnd(2, 5, 16))
    with pytest.raises(ValueError, match="x must be"):
        pool(rnd(2, 0, 32))
    with pytest.raises(ValueError, match="num_heads"):
        VisionTransformer(embed_dim=30, num_heads=4, depth=1, global_pool="map", device="meta")


def test_attention_pool_center_keys_same_function():
    """With use_flash_attn the pool centers its keys over the tokens (softmax is unchanged by it):
    the output and every gradient equal the uncentered pool's in float64; the torch path does not
    center."""
    assert AttentionPoolLatent(D, num_heads=H, use_flash_attn=True).center_keys
    assert not AttentionPoolLatent(D, num_heads=H).center_keys
    sd = pool_state(prefix="", latent_len=2)
    outs = []
    for center in (True, False):
        m = AttentionPoolLatent(D, num_heads=H, mlp_ratio=2.0, latent_len=2, pool_type="", norm_layer=partial_ln(),
                                use_flash_attn=True, dtype=F64)
        m.load_state_dict(sd)
        m.center_keys = center
        x = (rnd(3, 11, D, scale=1.0) + 2.0).requires_grad_(True) if not outs else outs[0][2].detach().clone()
        x.requires_grad_(True)
        y = m(x)
        y.square().sum().backward()
        outs.append((y.detach(), [p.grad for p in m.parameters()] + [x.grad], x))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-12, rtol=1e-11)
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.allclose(a, b, atol=1e-11, rtol=1e-10)
