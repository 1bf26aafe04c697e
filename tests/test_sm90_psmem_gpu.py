"""sm90_fwd with P through shared memory (``p_smem``, kPSmem) and the 3-consumer d64 tiles on the GPU,
the FlashAttention way: fresh random inputs, outputs poisoned (NaN) before each launch, error
against the float64 reference within 2x the error of plain attention computed in the same low
precision, LSE within 1e-2.

* every kernel of KERNELS over seqlens 1, 17, 113, 1023, 2049 with s_q != s_k both ways, MHA / GQA /
  MQA, and a real head dim below the kernel's (48 on d64: TMA zero-fills the columns);
* several tiles per CTA (batch 3 x 16 heads x 2049 rows, GQA 16:4) and s_q > s_k causal (tiles
  without keys between tiles with keys), for the persistent kernels;
* the flag on / off at one tile (c3 BN128 causal): both paths round P to 16 bits the same way and
  run the same blocks, so the outputs agree within 1e-3 of the output scale.

* tree_max (softmax_tree.cuh) and q_double (two Q buffers) on the heuristic's d64 tile: bit for bit
  the plain kernel's output; both also in KERNELS (against the reference).

11 compiles (KERNELS and flag_variants), a minute on an H100 after
tests/sm90_fwd_d64_precompile.py:
    CUDA_LAUNCH_BLOCKING=1 timeout 300 python -m pytest -q tests/test_sm90_psmem_gpu.py
"""
import math

import pytest

import cuflash
from cuflash import registry
from cuflash.families.sm90_fwd import Sm90FwdConfig

from test_features_gpu import check_close, feature_attention, inputs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

FAM = registry.get("sm90_fwd")
DYN3 = dict(BM=192, consumers=3, pingpong=True, persistent=True, dynamic=True)
# (dtype, head dim, causal, tile): one compiled kernel each
KERNELS = [
    ("bf16", 64, False, dict(DYN3, BN=192, p_smem=True)),        # FA3's non-causal d64 tile
    ("bf16", 64, True, dict(DYN3, BN=176, p_smem=True, tree_max=True, q_double=True)),
    ("fp16", 64, False, dict(DYN3, BN=192, p_smem=True, q_double=True)),
    ("bf16", 64, True, dict(DYN3, BN=128)),                      # FA3's causal d64 tile, P in registers
    ("bf16", 64, False, dict(DYN3, BN=160, p_smem=True, tree_max=True, q_double=True)),  # a partial P chunk
    ("bf16", 64, True, dict(DYN3, BN=128, p_smem=True, persistent=False, dynamic=False)),   # a CTA per tile
    ("bf16", 128, False, dict(DYN3, BN=128, p_smem=True)),       # two 64-column chunks of Q, K, V
    ("fp16", 64, True, dict(DYN3, BN=176, p_smem=True, pingpong=False, dynamic=False, q_double=True)),
]
SEQLENS = [(1, 17), (17, 1), (113, 1023), (1023, 113), (2049, 1023), (1023, 2049), (2049, 2049)]
HEADS = ("mha", "gqa", "mqa")


def config_of(k, head_dim=None):
    dtype, d, causal, tile = k
    return Sm90FwdConfig(stages=2, head_dim=FAM.head_dim_of(head_dim or d), dtype=dtype, causal=causal,
                         **tile).validate(227 * 1024)


def flag_variants():
    """The heuristic's d64 tile (bf16, non-causal, 2 consumer warpgroups, BN 192, dynamic): plain,
    with tree_max, with q_double (sm90_fwd_d64_timing.py's heur, heur_tree and heur_q2 rows)."""
    base = Sm90FwdConfig(BM=128, BN=192, stages=2, consumers=2, pingpong=True, persistent=True,
                         head_dim=64, dtype="bf16", causal=False, dynamic=True)
    return base, base.replace(tree_max=True), base.replace(q_double=True)


def configs():
    """Every kernel this file compiles (tests/sm90_fwd_d64_precompile.py)."""
    return [config_of(k) for k in KERNELS] + list(flag_variants())


def kid(k):
    dtype, d, causal, tile = k
    c = config_of(k)
    return f"{dtype}-d{d}-{'causal' if causal else 'full'}-c{c.consumers}-BN{c.BN}" + \
        ("-psmem" if c.p_smem else "") + ("" if c.persistent else "-grid")


def check(k, q, kk, v, what):
    import torch

    dtype, d, causal, tile = k
    cfg = config_of(k, q.shape[-1])
    out, lse, _ = cuflash.flash_attn_func(q, kk, v, causal=causal, config=cfg, return_attn_probs=True)
    scale = q.shape[-1] ** -0.5
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
    return cfg, out


@pytest.mark.parametrize("k", KERNELS, ids=kid)
def test_forward(k):
    dtype, d, causal, tile = k
    for i, (sq, sk) in enumerate(SEQLENS):
        heads = HEADS[i % 3]
        q, kk, v, _ = inputs(2, sq, sk, heads, d, dtype)
        cfg, _ = check(k, q, kk, v, f"{sq}x{sk} {heads}")
        assert cfg.p_smem == tile.get("p_smem", False)
    if d == 64:   # a real head dim below the kernel's: the columns past it are TMA's zeros
        q, kk, v, _ = inputs(2, 1023, 2049, "gqa", 48, dtype)
        check(k, q, kk, v, "d48 1023x2049 gqa")


@pytest.mark.parametrize("k", [k for k in KERNELS if k[3].get("persistent")], ids=kid)
def test_many_tiles_per_cta(k):
    import torch

    dtype, d, causal, tile = k
    h, hkv = 16, 4
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for b, sq, sk in ((3, 2049, 2049), (2, 3000, 700)):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=t)
        kk, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=t) for _ in range(2))
        check(k, q, kk, v, f"b{b} {sq}x{sk} h{h}:{hkv}")


def test_flag_on_and_off_agree():
    """The flag off and on at one tile: KERNELS[3] (c3 BN128 causal, P in registers) and KERNELS[5]
    (the same tile with p_smem, a CTA per tile) compute every row the same way (same blocks, same
    16-bit P), so their outputs agree to rounding."""
    for a, b, causal in ((KERNELS[3], KERNELS[5], True),):
        q, kk, v, _ = inputs(2, 2049, 2049, "gqa", 64, "bf16")
        outs = [cuflash.flash_attn_func(q, kk, v, causal=causal, config=config_of(x)) for x in (a, b)]
        assert not any(o.isnan().any() for o in outs)
        err = (outs[0].float() - outs[1].float()).abs().max().item()
        assert err <= 1e-3 * max(1.0, outs[0].float().abs().max().item()), f"{kid(a)} vs {kid(b)}: {err:.3g}"


@pytest.mark.parametrize("flag", ["tree_max", "q_double"])
def test_flag_is_bit_for_bit(flag):
    """tree_max changes only the order of the row max (exact in any order; the row sums keep
    softmax_step's order), q_double only which buffer holds Q: out and LSE equal the plain kernel's
    bit for bit, and match the reference (ragged seqlens, GQA / MQA, s_q != s_k; several tiles per
    CTA, so both Q buffers and their phases are used)."""
    import torch

    plain, tree, q2 = flag_variants()
    other = tree if flag == "tree_max" else q2
    for b, sq, sk, heads in ((2, 2049, 1023, "gqa"), (2, 1023, 2049, "mqa"), (2, 113, 113, "mha"),
                             (3, 3000, 2049, "gqa")):
        q, kk, v, _ = inputs(b, sq, sk, heads, 64, "bf16")
        outs = [cuflash.flash_attn_func(q, kk, v, causal=False, config=c.validate(227 * 1024),
                                        return_attn_probs=True)[:2] for c in (plain, other)]
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), \
            f"{other.name} b{b} {sq}x{sk}: differs from {plain.name}"
        ref, _ = feature_attention(q, kk, v, 64 ** -0.5, False, (-1, -1), 0.0, None, torch.float64)
        low, _ = feature_attention(q, kk, v, 64 ** -0.5, False, (-1, -1), 0.0, None, q.dtype)
        check_close(outs[1][0], ref, low, 2, f"{other.name} b{b} {sq}x{sk} {heads}")
