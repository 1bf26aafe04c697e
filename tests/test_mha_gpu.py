"""cuflash.modules.mha.MHA on the GPU (use_flash_attn=True: cuflash's kernels, the rotary kernel),
the FlashAttention way: the module's output and gradients (x, Wqkv / Wq, out_proj weights) must be
within 2x (3x for gradients) the error of the same attention computed plainly in the module's
dtype (tests/mha_reference.py: projections and matmuls in bf16 / fp16, softmax in fp32), both
against that computation in float64 on the same weights and inputs.

Compile count: the forward and backward kernels the cases select (head dim 64: dense causal and
not, varlen, ALiBi + window, GQA), the decode kernels, two rotary instantiations. Run the cases
in parallel processes (-k) the first time to fill CuPy's cache.
"""
import pytest

torch = pytest.importorskip("torch")

from cuflash.modules.mha import MHA  # noqa: E402
from cuflash.utils.generation import InferenceParams  # noqa: E402

from mha_reference import reference_mha  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

EMBED, HEADS = 512, 8          # head dim 64


def rule(got, ref, base, factor, what):
    err = (got.double() - ref).abs().max().item()
    base_err = (base.double() - ref).abs().max().item()
    assert err <= factor * base_err + 1e-6, f"{what}: error {err:.3e} > {factor} x plain {base_err:.3e}"
    return err, base_err


def check_module(m, x, kw=None, ref_kw=None, rows=None, grad_names=("Wqkv.weight", "out_proj.weight")):
    """Forward and backward of m (low precision, cuflash) against reference_mha in float64 and the
    plain baseline in m's dtype; rows: a boolean index of the output rows compared."""
    kw, ref_kw = kw or {}, ref_kw or {}
    dtype = m.out_proj.weight.dtype
    params = [x] + [dict(m.named_parameters())[n] for n in grad_names]
    out = m(x, **kw)
    ref = reference_mha(m, x, dtype=torch.float64, **ref_kw)
    base = reference_mha(m, x, dtype=dtype, **ref_kw)
    if rows is not None:
        out, ref, base = out[rows], ref[rows], base[rows]
    assert not out.isnan().any()
    rule(out, ref, base, 2, "out")
    dout = torch.randn_like(out)
    got_g = torch.autograd.grad(out, params, dout)
    ref_g = torch.autograd.grad(ref, params, dout.double())
    base_g = torch.autograd.grad(base, params, dout)
    for name, g, r, b in zip(("x",) + tuple(grad_names), got_g, ref_g, base_g):
        rule(g, r, b, 3, f"d{name}")


CASES = {
    "causal_rotary": dict(causal=True, rotary_emb_dim=64),
    "gqa_rotary_partial_gptj": dict(num_heads_kv=2, causal=True, rotary_emb_dim=32, rotary_emb_interleaved=True),
    "alibi_window": dict(causal=True, use_alibi=True, window_size=(64, 0)),
    "xpos": dict(causal=True, rotary_emb_dim=64, rotary_emb_scale_base=512),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_self_attention(case):
    torch.manual_seed(1)
    kw = CASES[case]
    m = MHA(EMBED, HEADS, use_flash_attn=True, device="cuda", dtype=torch.bfloat16, **kw)
    x = torch.randn(2, 257, EMBED, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref_kw = {"window": kw["window_size"], "alibi": True} if kw.get("use_alibi") else {}
    check_module(m, x, ref_kw=ref_kw)


def test_fp16_mqa_noncausal():
    m = MHA(EMBED, HEADS, num_heads_kv=1, use_flash_attn=True, device="cuda", dtype=torch.float16)
    x = torch.randn(3, 130, EMBED, device="cuda", dtype=torch.float16, requires_grad=True)
    check_module(m, x)


def test_cross_attention():
    m = MHA(EMBED, HEADS, cross_attn=True, use_flash_attn=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 100, EMBED, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_kv = torch.randn(2, 333, EMBED, device="cuda", dtype=torch.bfloat16)
    check_module(m, x, kw={"x_kv": x_kv}, ref_kw={"x_kv": x_kv}, grad_names=("Wq.weight", "Wkv.weight"))


def test_key_padding_mask():
    m = MHA(EMBED, HEADS, causal=True, rotary_emb_dim=64, use_flash_attn=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 200, EMBED, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.arange(200, device="cuda")[None] < torch.tensor([200, 117, 1], device="cuda")[:, None]
    check_module(m, x, kw={"key_padding_mask": mask}, ref_kw={"key_padding_mask": mask}, rows=mask)


@pytest.mark.parametrize("kw", [dict(causal=True, rotary_emb_dim=64),
                                dict(num_heads_kv=4, causal=True, rotary_emb_dim=32)], ids=["mha", "gqa"])
def test_varlen(kw):
    """Packed sequences (lengths 1, 0, 77, 300) with cu_seqlens: each against its own dense
    reference, rotary restarting per sequence; gradients through the packed batch."""
    m = MHA(EMBED, HEADS, use_flash_attn=True, device="cuda", dtype=torch.bfloat16, **kw)
    lens = [1, 0, 77, 300]
    cu = torch.tensor([0, 1, 1, 78, 378], dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lens), EMBED, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = m(x, cu_seqlens=cu, max_seqlen=max(lens))

    def per_sequence(dtype):
        parts = [reference_mha(m, x[int(cu[b]):int(cu[b + 1])][None], dtype=dtype)[0] for b in range(4) if lens[b]]
        return torch.cat(parts)

    ref, base = per_sequence(torch.float64), per_sequence(torch.bfloat16)
    rule(out, ref, base, 2, "out")
    dout = torch.randn_like(out)
    params = [x, m.Wqkv.weight]
    for name, g, r, b in zip(("x", "Wqkv"), torch.autograd.grad(out, params, dout),
                             torch.autograd.grad(ref, params, dout.double()), torch.autograd.grad(base, params, dout)):
        rule(g, r, b, 3, f"d{name}")


@pytest.mark.parametrize("kw", [dict(rotary_emb_dim=64), dict(rotary_emb_dim=24, num_heads_kv=2)],
                         ids=["rotary64_fused", "rotary24_gqa"])
def test_decoding(kw):
    """A 100-token prompt, then 4 tokens one at a time through flash_attn_with_kvcache (rotary 64:
    rotary applied by the decode kernel; rotary 24: by the rotary kernel first); each step's output
    against the full causal sequence's row."""
    torch.manual_seed(2)
    m = MHA(EMBED, HEADS, causal=True, layer_idx=0, use_flash_attn=True, device="cuda", dtype=torch.bfloat16, **kw)
    x = torch.randn(2, 104, EMBED, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref, base = reference_mha(m, x, dtype=torch.float64), reference_mha(m, x, dtype=torch.bfloat16)
        params = InferenceParams(max_seqlen=128, max_batch_size=2)
        outs = [m(x[:, :100], inference_params=params)]
        params.seqlen_offset = 100
        for t in range(100, 104):
            outs.append(m(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    rule(torch.cat(outs, dim=1), ref, base, 2, "decode out")
