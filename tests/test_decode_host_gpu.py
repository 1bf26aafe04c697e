"""flash_attn_with_kvcache's lean host path on the GPU (issue 13's host budget):

* without ``return_softmax_lse`` no LSE tensor is made and the kernels get a null ``lse`` (they
  skip its store): the output equals, bit for bit, that of the same call with the LSE (same plan,
  same split count), on every store path: one split (the main kernel writes O directly), the
  fused combine with early merge, the separate decode_combine launch, the Hopper loop (small
  pages), fp16 d 64; NaN-poisoned outputs first, and the LSE call checked against the float64
  reference (test_decode_gpu.check_call);
* the plan key reads a contiguous tensor's layout as ``is_contiguous()``: a q whose size-1
  dimension has another stride runs the same plan and gives the same output; a strided q gets
  its own plan;
* a CUDA graph captured without the LSE replays as the eager call.

Compiles: at most 5 kernel sets (bf16 d 128: one split, fused, separate combine; the Hopper loop
at page 16; fp16 d 64).
"""
import numpy as np
import pytest

from cuflash import api, decode
from cuflash.families import decode_splitkv as fam_mod

from test_decode_gpu import check_call, make_case

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)


# (batch, seqlen_q, lens, nheads, nheads_kv, d, dtype, page, num_splits, fused combine)
CASES = [
    (2, 1, [2049, 700], 32, 8, 128, "bf16", None, 1, True),      # one split: O stored directly
    (1, 1, [8192 + 113], 32, 8, 128, "bf16", None, 0, True),     # fused combine, early merge
    (3, 2, [1023, 17, 2049], 32, 8, 128, "bf16", None, 4, False),  # decode_combine
    (2, 1, [2049, 1], 32, 8, 128, "bf16", 16, 0, False),         # small pages: the Hopper loop
    (3, 1, [113, 4000, 1], 8, 2, 64, "fp16", None, 5, True),     # fp16 d 64, fused
]


def _ids(c):
    return f"b{c[0]}_q{c[1]}_h{c[3]}x{c[4]}_d{c[5]}_{c[6]}_page{c[7]}_split{c[8]}_{'fc' if c[9] else 'sep'}"


@pytest.fixture
def fresh_plans(monkeypatch):
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})
    yield
    decode._drop_gpu_plans()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_no_lse_output_equals_lse_call(case, monkeypatch, fresh_plans):
    import torch

    b, sq, lens, h, hk, d, dtype, page, splits, fused = case
    monkeypatch.setattr(fam_mod, "FUSED_COMBINE_DEFAULT", fused)
    rng = np.random.default_rng()
    args = make_case(rng, b, sq, lens, h, hk, d, dtype, page=page)
    kw = dict(causal=sq > 1, num_splits=splits)
    check_call(args, dtype, "with lse", **kw)              # the LSE call against the reference
    with_lse, lse = decode.flash_attn_with_kvcache(**args, return_softmax_lse=True, **kw)
    plans = len(decode._gpu_plans)
    out = decode.flash_attn_with_kvcache(**args, **kw)
    torch.cuda.synchronize()
    assert isinstance(out, torch.Tensor) and out.shape == args["q"].shape
    assert len(decode._gpu_plans) == plans, "the no-LSE call made a plan of its own"
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    assert torch.equal(out, with_lse), f"max |diff| {(out.float() - with_lse.float()).abs().max():.3g}"
    (entry,) = [e for e in decode._gpu_plans.values() if e.plan is not None]
    cfg = entry.plan.config
    assert cfg.tma == (page == 16)
    if page is None and splits > 1:
        assert cfg.fused_combine == fused and cfg.splits == splits


def test_size1_stride_shares_the_plan(fresh_plans):
    import torch

    rng = np.random.default_rng()
    args = make_case(rng, 2, 1, [2049, 300], 32, 8, 128, "bf16")
    q = args["q"]
    out = decode.flash_attn_with_kvcache(**args)
    # seqlen_q = 1: its stride is never multiplied by a non-zero index
    q1 = torch.empty(2, 1, 32 * 128 * 3, device="cuda", dtype=q.dtype)[:, :, :32 * 128].view(2, 1, 32, 128)
    q1 = q1.as_strided(q.shape, (q.stride(0), 7 * 8, 128, 1))
    q1.copy_(q)
    assert q1.is_contiguous() and q1.stride() != q.stride()
    out1 = decode.flash_attn_with_kvcache(**dict(args, q=q1))
    torch.cuda.synchronize()
    assert len(decode._gpu_plans) == 1 and torch.equal(out, out1)
    # a strided q (heads apart by 2 x 128) keys its own plan
    q2 = torch.empty(2, 1, 64, 128, device="cuda", dtype=q.dtype)[:, :, ::2]
    q2.copy_(q)
    out2 = decode.flash_attn_with_kvcache(**dict(args, q=q2))
    torch.cuda.synchronize()
    assert len(decode._gpu_plans) == 2 and torch.equal(out, out2)


def test_cuda_graph_without_lse(fresh_plans):
    import torch

    rng = np.random.default_rng()
    args = make_case(rng, 4, 1, [100, 2000, 5, 3000], 32, 8, 128, "bf16", seqlen_new=1)
    cap = args["k_cache"].shape[1]
    static = dict(args)
    decode.flash_attn_with_kvcache(**{k: (v.clone() if k in ("k_cache", "v_cache") else v)
                                      for k, v in static.items()})  # warm-up: plan, kernels, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.flash_attn_with_kvcache(**static)
    for step in range(2):
        static["cache_seqlens"].copy_(torch.tensor(rng.integers(0, cap - 1, size=4), dtype=torch.int32))
        static["q"].copy_(torch.randn_like(static["q"]))
        kc, vc = static["k_cache"].clone(), static["v_cache"].clone()
        graph.replay()
        torch.cuda.synchronize()
        eager = decode.flash_attn_with_kvcache(**dict(static, k_cache=kc, v_cache=vc))
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"step {step}: graph replay differs from eager"
