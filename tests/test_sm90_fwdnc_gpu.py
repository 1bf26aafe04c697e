"""sm90_fwd's non-causal d128 / d256 candidates of tests/sm90_fwd_nc_timing.py and the dynamic
scheduler's explicit sections (``section``) on the GPU, the FlashAttention way: fresh random inputs,
outputs poisoned (NaN) before each launch, error against the float64 reference within 2x the error
of plain attention computed in the same low precision.

* every kernel of KERNELS (the heuristic's tile, dynamic persistent, with the changes in the id) over
  seqlens 1, 17, 113, 1023, 2049 with s_q != s_k both ways, MHA / GQA / MQA (rescale_first,
  kRescaleFirst, without and with pingpong, causal and not, bf16 and fp16);
* rescale_first against the same tile without it, bit for bit;
* sections 1, 3 (not a power of two: the last section shorter), 1024 (more than the pairs) against
  the L2 rule's (section 0): the same kernel, only the tile order differs, so out and LSE are equal
  bit for bit, over a shape with several tiles per CTA and GQA;
* a CUDA graph of a section-1 call replays on new inputs.

10 compiles (tests/sm90_fwd_nc_timing.py --precompile-only --with-tests compiles them in
parallel), about a minute on an H100:
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_fwdnc_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry

from test_features_gpu import check_close, feature_attention, inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_fwd")
# (dtype, head dim, causal, changes to the heuristic's tile, persistent): one compiled kernel each
KERNELS = [
    ("bf16", 128, False, {"BN": 176, "tma_store": False, "dynamic": False}),   # the heuristic's from 16k
    ("fp16", 128, False, {"BN": 160, "tma_store": True, "dynamic": True}),     # the dynamic one below 16k
    ("bf16", 128, False, {"BN": 160, "tma_store": True, "dynamic": False, "rescale_first": True}),
    ("bf16", 256, False, {"dynamic": True, "pingpong": True}),
    ("bf16", 256, False, {"BN": 64, "dynamic": False, "pingpong": False}),
    ("bf16", 256, False, {"dynamic": False, "pingpong": False}),              # the heuristic's
    ("bf16", 256, False, {"dynamic": False, "pingpong": False, "rescale_first": True}),
    ("fp16", 256, False, {"dynamic": False, "pingpong": False}),
    ("bf16", 256, True, {"dynamic": True, "pingpong": False, "rescale_first": True}),
    ("bf16", 128, True, {"dynamic": True, "rescale_first": True}),            # with pingpong
]
DYNAMIC = [KERNELS[1], KERNELS[3]]
# rescale_first against the same tile without it: the same multiplies and GEMMs, only issued in
# another order, so out and LSE are equal bit for bit
RF_PAIRS = [(KERNELS[2], ("bf16", 128, False, {"BN": 160, "tma_store": True, "dynamic": False})),
            (KERNELS[6], KERNELS[5])]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")


def kid(k):
    dtype, d, causal, change = k
    return "-".join([dtype, f"d{d}", "causal" if causal else "full", *(f"{a}{int(b)}" for a, b in change.items())])


def tile_of(heuristic, change):
    """The heuristic's config, persistent, without stream_tail and lazy_rescale (which the heuristic sets
    for some cells: HEURISTIC_STREAM_TAIL, HEURISTIC_LAZY), with ``change`` (tests/sm90_fwd_nc_timing.py
    --with-tests compiles the same)."""
    return heuristic.replace(persistent=True, tma_store=False, stream_tail=False,
                             lazy_rescale=False).replace(**change)


def config_for(k, q, kk, section=0):
    from conftest import device_heuristic

    dtype, d, causal, change = k
    p = cuflash.Problem("fwd", dtype, q.shape[0], q.shape[1], kk.shape[1], q.shape[2], kk.shape[2], d, causal)
    cfg = tile_of(device_heuristic(FAM, p), change)
    return cfg.replace(section=section if cfg.dynamic else 0).validate(227 * 1024)


def check(k, q, kk, v, what, section=0, cfg=None):
    """The call with config ``cfg`` (default: config_for's) against the float64 reference."""
    import torch

    causal = k[2]
    cfg = cfg or config_for(k, q, kk, section)
    out, lse, _ = cuflash.flash_attn_func(q, kk, v, causal=causal, config=cfg, return_attn_probs=True)
    scale = k[1] ** -0.5
    ref, ref_lse = feature_attention(q, kk, v, scale, causal, (-1, -1), 0.0, None, torch.float64)
    low, _ = feature_attention(q, kk, v, scale, causal, (-1, -1), 0.0, None, q.dtype)
    what = f"{cfg.name} {what}"
    check_close(out, ref, low, 2, what)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE = +inf rows differ"
    if finite.any():
        err = (lse[finite].double() - ref_lse[finite]).abs().max().item()
        assert err < 1e-2, f"{what}: LSE error {err:.3g}"
    assert (lse[~finite] == math.inf).all(), f"{what}: rows with no key must have LSE = +inf"
    return cfg, out, lse


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_forward(k):
    for i, (sq, sk) in enumerate(SEQLENS):
        heads = HEADS[i % 3]
        q, kk, v, _ = inputs(2, sq, sk, heads, k[1], k[0])
        cfg, _, _ = check(k, q, kk, v, f"{sq}x{sk} {heads}", section=1 if i % 2 else 0)
        assert cfg.rescale_first == k[3].get("rescale_first", False) and cfg.causal == k[2]


@pytest.mark.parametrize("k", DYNAMIC, ids=kid)
def test_sections_equal_bit_for_bit(k):
    """batch 3 x 16 heads (GQA 16:4) x 2049 rows: several tiles per CTA; every section gives the
    L2 rule's out and LSE bit for bit (a tile's code is the same wherever it runs), and each
    matches the reference."""
    import torch

    from cuflash.families.sm90_fwd import sched_section

    dtype, d, _, _ = k
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    b, s, h, hkv = 3, 2049, 16, 4
    q = torch.randn(b, s, h, d, device="cuda", dtype=t)
    kk, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=t) for _ in range(2))
    cfg0, out0, lse0 = check(k, q, kk, v, "section 0")
    p = cuflash.Problem("fwd", dtype, b, s, s, h, hkv, d, False)
    assert [sched_section(p, n) for n in (1, 3, 1024)] == [4, 12, b * h]
    for n in (1, 3, 1024):
        cfg, out, lse = check(k, q, kk, v, f"section {n}", section=n)
        assert cfg.kernel_name() == cfg0.kernel_name() and cfg.section == n
        assert torch.equal(out, out0) and torch.equal(lse, lse0), f"{cfg.name}: differs from section 0"


@pytest.mark.parametrize("pair", RF_PAIRS, ids=lambda p: kid(p[0]))
def test_rescale_first_equals_the_plain_order_bit_for_bit(pair):
    """batch 3 x 16 heads (GQA 16:4) x 2049 rows, s_k 1500 (a ragged last K/V block): rescale_first's
    out and LSE equal the plain kernel's bit for bit."""
    import torch

    rf, plain = pair
    dtype, d = rf[0], rf[1]
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    q = torch.randn(3, 2049, 16, d, device="cuda", dtype=t)
    kk, v = (torch.randn(3, 1500, 4, d, device="cuda", dtype=t) for _ in range(2))
    cfg_rf, out_rf, lse_rf = check(rf, q, kk, v, "rescale_first")
    cfg, out, lse = check(plain, q, kk, v, "plain")
    assert cfg_rf == cfg.replace(rescale_first=True)
    assert torch.equal(out_rf, out) and torch.equal(lse_rf, lse), f"{cfg_rf.name}: differs from {cfg.name}"


def test_section_in_a_cuda_graph():
    import torch

    k = KERNELS[1]
    b, s, h, d = 2, 2049, 16, 128
    q, kk, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    cfg = config_for(k, q, kk, section=1)
    assert cfg.section == 1 and cfg.dynamic
    cuflash.flash_attn_func(q, kk, v, config=cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuflash.flash_attn_func(q, kk, v, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = cuflash.flash_attn_func(q, kk, v, config=cfg)
    for _ in range(2):
        for x in (q, kk, v):
            x.copy_(torch.randn_like(x))
        static_out.fill_(math.nan)
        graph.replay()
        eager = cuflash.flash_attn_func(q, kk, v, config=cfg)
        torch.cuda.synchronize()
        assert not static_out.isnan().any(), "graph replay left unwritten (NaN) outputs"
        assert torch.equal(static_out, eager)
