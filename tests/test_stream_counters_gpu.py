"""Plan-owned counters per CUDA stream (cuflash.launch.StreamCounters, issue 13) on the GPU: calls
of one call shape on two streams at once, each with its own inputs, must each equal an eager call
on one stream bit for bit (a shared counter would mix the two calls' counts: the fused decode
combine would merge before every split is written, the dynamic scheduler would skip tiles, left
NaN by the poisoning) and leave every stream's counters at 0.

* decode_splitkv with the fused combine (16 splits of 8 KV heads: 128 CTAs of one call, so the
  two streams' kernels run side by side);
* sm90_fwd's dynamic persistent scheduler (the device heuristic's tile, persistent + dynamic);
* a CUDA graph captured after eager calls on two other streams (its capture stream takes the
  plan's spare buffer) replays next to eager calls.

Compiles: 2 (decode bf16 d128 fused combine, sm90_fwd bf16 d128 causal dynamic).
    CUDA_LAUNCH_BLOCKING=0 timeout 300 python -m pytest -q tests/test_stream_counters_gpu.py
(no CUDA_LAUNCH_BLOCKING: the point is that launches overlap)
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import decode, registry

pytestmark = [pytest.mark.gpu]
ROUNDS = 20


@pytest.fixture(autouse=True)
def _poison(poison_outputs):
    """NaN outputs before each launch (conftest.poison_outputs)."""


def _counters_all_zero(plan):
    import cupy
    import torch

    torch.cuda.synchronize()
    for name, sc in plan.counters.items():
        for stream, buf in sc.buffers.items():
            vals = cupy.ndarray((sc.n,), cupy.int32, buf).get()
            assert not vals.any(), f"{plan.config.name} {name} stream {stream:#x}: left {vals.tolist()}"


def _two_streams(f, inputs_a, inputs_b):
    """f on a and b: once eagerly on the current stream each, then ROUNDS times interleaved on two
    side streams; returns (eager a, eager b, [side a...], [side b...])."""
    import torch

    ref_a, ref_b = f(*inputs_a), f(*inputs_b)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    outs_a, outs_b = [], []
    for _ in range(ROUNDS):
        with torch.cuda.stream(s1):
            outs_a.append(f(*inputs_a))
        with torch.cuda.stream(s2):
            outs_b.append(f(*inputs_b))
    torch.cuda.synchronize()
    return ref_a, ref_b, outs_a, outs_b


def test_decode_fused_combine_two_streams(monkeypatch):
    import torch

    from cuflash.families import decode_splitkv as fam_mod

    # one batch row of 6000 keys: the fused merge (REGS_BATCH1_RULES' first entry gives it the separate combine)
    monkeypatch.setattr(fam_mod, "REGS_BATCH1_RULES", ((8192, {}),) + tuple(fam_mod.REGS_BATCH1_RULES[1:]))
    decode._drop_gpu_plans()
    monkeypatch.setattr(decode, "_gpu_plans", {})

    def make():
        return dict(q=torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16),
                    k_cache=torch.randn(1, 6000, 8, 128, device="cuda", dtype=torch.bfloat16),
                    v_cache=torch.randn(1, 6000, 8, 128, device="cuda", dtype=torch.bfloat16),
                    cache_seqlens=torch.tensor([5999], dtype=torch.int32, device="cuda"))

    a, b = make(), make()

    def f(x):
        return decode.flash_attn_with_kvcache(**x, num_splits=16)

    ref_a, ref_b, outs_a, outs_b = _two_streams(f, (a,), (b,))
    assert not ref_a.isnan().any() and not torch.equal(ref_a, ref_b)
    for i, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        assert torch.equal(oa, ref_a), f"round {i}: stream 1 differs from the eager call"
        assert torch.equal(ob, ref_b), f"round {i}: stream 2 differs from the eager call"
    plans = [e.plan for e in decode._gpu_plans.values() if e.plan is not None and e.plan.config.splits == 16]
    assert len(plans) == 1 and plans[0].config.fused_combine, [p.config.name for p in plans]
    sc = plans[0].counters["split_counters"]
    assert len(sc.buffers) >= 3 and len({int(x.ptr) for x in sc.buffers.values()}) == len(sc.buffers)
    _counters_all_zero(plans[0])

    # a graph captured on a fresh stream (the plan's spare), replayed beside eager calls on others
    cap = torch.cuda.Stream()   # its own capture stream (torch's pool hands the next one to s1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=cap):
        static = f(a)
    s1 = torch.cuda.Stream()
    assert s1.cuda_stream != cap.cuda_stream
    s1.wait_stream(torch.cuda.current_stream())
    eager = []
    for _ in range(ROUNDS):
        graph.replay()
        with torch.cuda.stream(s1):
            eager.append(f(b))
    torch.cuda.synchronize()
    assert torch.equal(static, ref_a) and all(torch.equal(e, ref_b) for e in eager)
    _counters_all_zero(plans[0])


def test_sm90_fwd_dynamic_two_streams():
    import torch

    from conftest import device_heuristic

    fam = registry.get("sm90_fwd")
    b, s, h, hkv, d = 1, 1023, 8, 2, 128   # few tiles: the two calls' CTAs share the GPU

    def make():
        return (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16))

    qa, qb = make(), make()
    p = cuflash.Problem("fwd", "bf16", b, s, s, h, hkv, d, True)
    cfg = device_heuristic(fam, p).replace(persistent=True, dynamic=True, tma_store=False).validate(227 * 1024)

    def f(q, k, v):
        return cuflash.flash_attn_func(q, k, v, causal=True, config=cfg)

    ref_a, ref_b, outs_a, outs_b = _two_streams(f, qa, qb)
    assert not ref_a.isnan().any() and not ref_b.isnan().any()
    for i, (oa, ob) in enumerate(zip(outs_a, outs_b)):
        assert not oa.isnan().any() and not ob.isnan().any(), f"round {i}: skipped tiles (NaN)"
        assert torch.equal(oa, ref_a) and torch.equal(ob, ref_b), f"round {i}: differs from the eager call"
    # the reference: plain attention's error bound, once (the scheduler changes the order only)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qa[0].transpose(1, 2).float(), qa[1].transpose(1, 2).float(), qa[2].transpose(1, 2).float(),
        is_causal=True, enable_gqa=True).transpose(1, 2)
    assert (ref_a.float() - ref).abs().max().item() < 2e-2 * math.sqrt(d / 64)
    assert np.isfinite(ref_a.float().cpu().numpy()).all()
