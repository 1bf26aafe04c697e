"""sm90_fwd's dynamic persistent scheduler (``dynamic``, kDynamic) and TMA-store epilogue
(``tma_store``, kTmaStore) on the GPU, the FlashAttention way: fresh random inputs, outputs poisoned (NaN) before each launch, error against the float64
reference within 2x the error of plain attention computed in the same low precision.

* every kernel of KERNELS (the device heuristic's tile, persistent, dynamic on, then the changes
  named in the id: layout, tma_store, dynamic off) over seqlens 1, 17, 113, 1023, 2049 with s_q != s_k both ways,
  MHA / GQA / MQA, and one shape with several tiles per CTA (a claim per tile);
* window, softcap, ALiBi once each; dropout bit for bit against the static persistent kernel
  (same seed: the tiles compute the same code, only their order and CTA differ);
* tma_store: ragged Q blocks and head dims below the kernel's (80 on d96, 200 on d256: the map
  clips rows and columns), one and two consumer warpgroups, with and without the scheduler;
* the counter's reset: two consecutive calls equal bit for bit (a stale counter would skip tiles,
  left NaN by the poisoning), then a CUDA-graph capture and 3 replays on new inputs (also with
  tma_store: O's tensor map holds the graph's output address).

18 compiles (KERNELS: 17, dropout's static twin: 1; the graph cases reuse KERNELS entries),
a few minutes on an H100:
    CUDA_LAUNCH_BLOCKING=1 timeout 600 python -m pytest -q tests/test_sm90_sched_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry

from test_features_gpu import check_close, feature_attention, inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_fwd")
# (dtype, head dim, causal, changes to the heuristic's tile, features): one compiled kernel each
KERNELS = [
    ("bf16", 64, False, {}, ()),
    ("bf16", 64, True, {}, ()),
    ("bf16", 128, True, {}, ()),
    ("fp16", 128, False, {}, ()),
    ("bf16", 256, True, {}, ()),
    ("bf16", 96, True, {}, ()),
    ("bf16", 128, True, {"pingpong": False}, ()),
    ("bf16", 64, True, {"BM": 192, "consumers": 3, "BN": 96}, ()),    # pingpong over 3 warpgroups
    ("bf16", 128, False, {"BM": 64, "consumers": 1, "pingpong": False, "BN": 128}, ()),
    ("bf16", 128, True, {}, ("window",)),
    ("bf16", 128, False, {}, ("softcap",)),
    ("bf16", 128, True, {}, ("alibi",)),
    # the TMA-store epilogue
    ("bf16", 64, False, {"BM": 128, "consumers": 2, "BN": 192, "tma_store": True}, ()),   # (the heuristic's
    # d64 tile is BM 192 with 3 consumers from the 2048 bucket: HEURISTIC_D64; with tma_store it spills)
    ("bf16", 128, True, {"BN": 160, "tma_store": True}, ()),
    ("fp16", 80, False, {"BN": 128, "tma_store": True, "dynamic": False, "persistent": False}, ()),
    ("bf16", 200, True, {"BM": 64, "consumers": 1, "pingpong": False, "BN": 64, "tma_store": True}, ()),
    ("bf16", 128, False, {"BM": 64, "consumers": 1, "pingpong": False, "BN": 128, "tma_store": True,
                          "dynamic": False}, ()),
]
TMA_DYN = KERNELS[13]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")
WINDOW, SOFTCAP = (300, 0), 30.0


def kid(k):
    dtype, d, causal, change, feats = k
    return "-".join([dtype, f"d{d}", "causal" if causal else "full",
                     *(f"{a}{int(b)}" for a, b in change.items()), *feats])


def config_for(k, q, kk):
    """The device heuristic for the call with the changes, persistent and dynamic (validated)."""
    from conftest import device_heuristic

    dtype, d, causal, change, feats = k
    p = cuflash.Problem("fwd", dtype, q.shape[0], q.shape[1], kk.shape[1], q.shape[2], kk.shape[2], d,
                        causal, features=tuple(sorted(feats)),
                        softcap=SOFTCAP if "softcap" in feats else 0.0,
                        window=WINDOW if "window" in feats else (-1, -1))
    cfg = device_heuristic(FAM, p).replace(persistent=True, dynamic=True, tma_store=False).replace(**change)
    return cfg.validate(227 * 1024)


def run(k, q, kk, v, slopes=None):
    dtype, d, causal, change, feats = k
    cfg = config_for(k, q, kk)
    out, lse, _ = cuflash.flash_attn_func(
        q, kk, v, causal=causal, window_size=WINDOW if "window" in feats else (-1, -1),
        softcap=SOFTCAP if "softcap" in feats else 0.0, alibi_slopes=slopes, config=cfg,
        return_attn_probs=True)
    return cfg, out, lse


def check(k, q, kk, v, what):
    import torch

    dtype, d, causal, change, feats = k
    slopes = None
    if "alibi" in feats:
        slopes = torch.rand(q.shape[2], device="cuda", dtype=torch.float32) * 0.3
    cfg, out, lse = run(k, q, kk, v, slopes)
    scale = d ** -0.5
    w = WINDOW if "window" in feats else (-1, -1)
    cap = SOFTCAP if "softcap" in feats else 0.0
    ref, ref_lse = feature_attention(q, kk, v, scale, causal, w, cap, slopes, torch.float64)
    low, _ = feature_attention(q, kk, v, scale, causal, w, cap, slopes, q.dtype)
    what = f"{cfg.name} {what}"
    check_close(out, ref, low, 2, what)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE = +inf rows differ"
    if finite.any():
        err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
        assert err < 1e-2, f"{what}: LSE error {err:.3g}"
    assert (lse[~finite] == math.inf).all(), f"{what}: rows with no key must have LSE = +inf"
    return cfg


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_forward(k):
    dtype, d, causal, change, feats = k
    for i, (sq, sk) in enumerate(SEQLENS):
        heads = HEADS[i % 3]
        q, kk, v, _ = inputs(2, sq, sk, heads, d, dtype)
        cfg = check(k, q, kk, v, f"{sq}x{sk} {heads}")
        assert cfg.dynamic == k[3].get("dynamic", True) and cfg.tma_store == k[3].get("tma_store", False)


@pytest.mark.parametrize("k", [k for k in KERNELS if not k[4]][:5] + [TMA_DYN], ids=kid)
def test_many_tiles_per_cta(k):
    """batch 3 x 16 heads x 2049 rows (816 tiles of 128 rows, a few per SM; the claims, the
    section order and the ring's phases across tiles), GQA 16:4; and s_q > s_k causal (tiles
    without keys, O = 0 and LSE = +inf, between tiles with keys)."""
    import torch

    from cuflash.families.sm90_fwd import sched_section

    dtype, d, causal, change, feats = k
    h, hkv = 16, 4
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for b, sq, sk in ((3, 2049, 2049), (2, 3000, 700)):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=t)
        kk, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=t) for _ in range(2))
        cfg = check(k, q, kk, v, f"b{b} {sq}x{sk} h{h}:{hkv}")
        p = cuflash.Problem("fwd", dtype, b, sq, sk, h, hkv, d, causal)
        assert 1 <= sched_section(p) <= b * h, cfg.name


@pytest.mark.parametrize("tma", [False, True], ids=["regs", "tma_store"])
def test_dropout_matches_the_static_schedule_bit_for_bit(tma):
    """Dropout (d128 causal, its DROPOUT_BN): the dynamic kernel's out and LSE equal the static
    persistent kernel's on the same seed, over a shape with several tiles per CTA."""
    import torch

    from conftest import device_heuristic

    b, sq, sk, h, hkv, d = 2, 2049, 1500, 16, 4, 128
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    kk, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    p = cuflash.Problem("fwd", "bf16", b, sq, sk, h, hkv, d, True, features=("dropout",))
    base = device_heuristic(FAM, p).replace(persistent=True)
    outs = []
    for dyn in (False, True):
        cfg = base.replace(dynamic=dyn, tma_store=tma and dyn).validate(227 * 1024)
        assert cfg.dropout
        out, lse, _ = cuflash.flash_attn_func(q, kk, v, 0.17, causal=True, dropout_seed=(1234, 5),
                                              config=cfg, return_attn_probs=True)
        assert not out.isnan().any(), f"{cfg.name}: unwritten (NaN) outputs"
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("k", [("bf16", 128, True, {}, ()), TMA_DYN], ids=kid)
def test_counter_resets_between_calls_and_in_a_cuda_graph(k):
    """Two consecutive calls give the same output bit for bit (the kernel resets its claim counter;
    a stale one would skip tiles, left NaN by the poisoning), and a CUDA graph captured after the
    first call (the plan and its zeroed counter exist) replays 3 times on new inputs, each equal to
    an eager call on them."""
    import torch

    b, s, h, hkv, d = 3, 2049, 16, 4, 128
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    kk, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cfg = config_for(k, q, kk)
    first = cuflash.flash_attn_func(q, kk, v, causal=True, config=cfg)
    second = cuflash.flash_attn_func(q, kk, v, causal=True, config=cfg)
    assert not first.isnan().any() and torch.equal(first, second)
    check(k, q, kk, v, "after two calls")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on the capture stream, as torch's graph docs ask
        cuflash.flash_attn_func(q, kk, v, causal=True, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = cuflash.flash_attn_func(q, kk, v, causal=True, config=cfg)
    for _ in range(3):
        for x in (q, kk, v):
            x.copy_(torch.randn_like(x))
        static_out.fill_(math.nan)
        graph.replay()
        eager = cuflash.flash_attn_func(q, kk, v, causal=True, config=cfg)
        torch.cuda.synchronize()
        assert not static_out.isnan().any(), "graph replay left unwritten (NaN) outputs"
        assert torch.equal(static_out, eager), "graph replay differs from the eager call"
