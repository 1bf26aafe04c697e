"""cuflash.models.bert on the GPU (use_flash_attn=True: the unpadded path, cuflash's varlen
forward and backward kernels, non-causal, head dim 64) in bf16 and fp16, on a padded batch with
random lengths (1 and the full length included, odd seqlen 77).

* forward: BertForPreTraining's MLM logits at the kept tokens, the NSP logits and the pooled
  output against the same weights in float64 on the CPU (torch attention on the padded batch)
  within 2x the error of the same model in the same dtype with the plain torch attention
  (use_flash_attn=False, padded); the gradients of the word embedding and layer 0's Wqkv within 3x.
* the varlen path is taken: every layer's MLP sees exactly the kept tokens, and every
  attention call gets cu_seqlens (no compute on padding); the outputs at the padding are 0.
* last_layer_subset + dense_seq_output: the masked tokens' MLM logits (last layer on the subset
  only, a varlen cross-attention) against float64 within 2x the plain model's error there.
"""
import pytest

torch = pytest.importorskip("torch")

from cuflash.models.bert import BertConfig, BertForPreTraining  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

COMMON = dict(vocab_size=1000, pad_vocab_size_multiple=8, hidden_size=256, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=512, max_position_embeddings=128, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, initializer_range=0.1)
LENGTHS = [77, 1, 40, 77, 13, 2]
SEQLEN = 77
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make(flash, dtype, device="cuda", state=None, **extra):
    torch.manual_seed(0)
    m = BertForPreTraining(BertConfig(**COMMON, use_flash_attn=flash, **extra)).to(device=device, dtype=dtype)
    if state is not None:
        m.load_state_dict(state)
    return m.eval()


def batch():
    ids = torch.randint(1, 1000, (len(LENGTHS), SEQLEN))
    types_ = torch.randint(0, 2, ids.shape)
    mask = torch.arange(SEQLEN)[None] < torch.tensor(LENGTHS)[:, None]
    return ids, types_, mask


def max_err(got, ref):
    return (got.double().cpu() - ref.double().cpu()).abs().max().item()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_forward_and_grads_vs_float64(dtype):
    ref = make(False, torch.float64, device="cpu")
    state = ref.state_dict()
    flash = make(True, DTYPES[dtype], state=state)
    plain = make(False, DTYPES[dtype], state=state)
    ids, types_, mask = batch()
    dmlm = torch.randn(*ids.shape, 1000) * mask[..., None]
    outs = {}
    for key, m in (("ref", ref), ("flash", flash), ("plain", plain)):
        dev = next(m.parameters()).device
        out = m(ids.to(dev), token_type_ids=types_.to(dev), attention_mask=mask.to(dev))
        logits = out.prediction_logits[..., :1000]
        loss = (logits.float() * dmlm.to(dev)).sum() + out.seq_relationship_logits.float().sum()
        params = dict(m.named_parameters())
        names = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layers.0.mixer.Wqkv.weight"]
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        pooled = m.bert(ids.to(dev), token_type_ids=types_.to(dev), attention_mask=mask.to(dev)).pooler_output
        outs[key] = (logits.detach().cpu()[mask], out.seq_relationship_logits.detach(), pooled.detach(), grads)
    assert not outs["flash"][0].isnan().any()
    for i, what in enumerate(("MLM logits (kept tokens)", "NSP logits", "pooled")):
        err, base = max_err(outs["flash"][i], outs["ref"][i]), max_err(outs["plain"][i], outs["ref"][i])
        print(f"{dtype} {what}: error {err:.3e} (plain {dtype} {base:.3e})")
        assert err <= 2 * base + 1e-6, f"{what}: {err:.3e} > 2 x plain {base:.3e}"
    for i, (g, r, b) in enumerate(zip(outs["flash"][3], outs["ref"][3], outs["plain"][3])):
        gerr, gbase = max_err(g, r), max_err(b, r)
        print(f"{dtype} grad {i}: error {gerr:.3e} (plain {dtype} {gbase:.3e})")
        assert gerr <= 3 * gbase + 1e-6, f"grad {i}: {gerr:.3e} > 3 x plain {gbase:.3e}"


def test_varlen_path_taken():
    m = make(True, torch.bfloat16)
    ids, types_, mask = batch()
    rows, calls = [], []
    for layer in m.bert.encoder.layers:
        layer.mlp.fc1.register_forward_hook(lambda mod, a, o: rows.append(a[0].shape[0]))
        inner = layer.mixer.inner_attn
        orig = inner.forward

        def spy(qkv, *a, _orig=orig, **kw):
            calls.append((qkv.shape[0], kw.get("cu_seqlens")))
            return _orig(qkv, *a, **kw)
        inner.forward = spy
    with torch.no_grad():
        h = m.bert(ids.cuda(), token_type_ids=types_.cuda(), attention_mask=mask.cuda()).last_hidden_state
    total = sum(LENGTHS)
    print(f"varlen: {total} kept of {mask.numel()} padded tokens; MLP rows per layer {rows}")
    assert rows == [total] * 2
    assert [c[0] for c in calls] == [total] * 2 and all(c[1] is not None for c in calls)
    assert (h[~mask.cuda()] == 0).all() and not h[mask.cuda()].isnan().any()


def test_last_layer_subset_vs_float64():
    extra = dict(dense_seq_output=True)
    ref = make(False, torch.float64, device="cpu", **extra)
    state = {k: v for k, v in ref.state_dict().items()}
    subset = make(True, torch.bfloat16, last_layer_subset=True, **extra)
    from cuflash.models.bert import remap_state_dict, inv_remap_state_dict
    cfg = BertConfig(**COMMON, **extra)
    cfg_subset = BertConfig(**COMMON, last_layer_subset=True, **extra)
    subset.load_state_dict(remap_state_dict(inv_remap_state_dict(state, cfg), cfg_subset))
    plain = make(False, torch.bfloat16, state=state, **extra)
    ids, types_, mask = batch()
    labels = torch.where((torch.rand(ids.shape) < 0.2) & mask, torch.randint(1, 1000, ids.shape), 0)
    labels[:, 0] = 0
    labels[1, 0] = 0
    outs = {}
    with torch.no_grad():
        for key, m in (("ref", ref), ("subset", subset), ("plain", plain)):
            dev = next(m.parameters()).device
            out = m(ids.to(dev), token_type_ids=types_.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev))
            outs[key] = (out.prediction_logits[..., :1000], out.seq_relationship_logits)
    n = int((labels > 0).sum())
    assert outs["subset"][0].shape == (n, 1000)
    for i, what in enumerate(("masked-token MLM logits", "NSP logits")):
        err, base = max_err(outs["subset"][i], outs["ref"][i]), max_err(outs["plain"][i], outs["ref"][i])
        print(f"last_layer_subset {what} ({n} masked tokens): error {err:.3e} (plain bf16 {base:.3e})")
        assert err <= 2 * base + 1e-6, f"{what}: {err:.3e} > 2 x plain {base:.3e}"
