"""The sliding-window forward's tile choice on the GPU: sm90_fwd's heuristic gives a window BN =
128 and the persistent schedule (families/sm90_fwd.py window_tiles). Small problems give one
tile per CTA, so these problems have several tiles per SM (batch 4 x 6 heads x 17 Q blocks =
408 tiles on 132 SMs): each CTA runs tiles of different loop lengths (the first Q blocks of a
window are shorter) through one K/V ring and one pingpong rotation.

Error vs the float64 reference within 2x that of plain attention with the same features in the
same low precision (tests/test_features_gpu.py's rule), outputs NaN-poisoned before the launch.
Three kernels to compile (d128 bf16): about a minute cold.
"""
import math

import pytest

import cuflash
from cuflash import registry

from conftest import device_heuristic  # noqa: E402
from test_features_gpu import check_close, feature_attention, inputs, problem_of, slopes_for  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

CASES = [  # (id, causal, window, softcap, alibi)
    ("window256_causal", True, (256, 0), 0.0, None),
    ("window300_129", False, (300, 129), 0.0, None),
    ("window200_causal_cap_alibi", True, (200, 0), 10.0, "h"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_persistent_window_forward(case):
    import torch

    _, causal, window, softcap, alibi = case
    fam = registry.get("sm90_fwd")
    for sq, sk in ((2049, 2049), (1500, 2049)):
        q, k, v, _ = inputs(4, sq, sk, "gqa", 128, "bf16")
        cfg = device_heuristic(fam, problem_of("fwd", q, k, case))
        assert cfg.persistent and cfg.BN == 128 and cfg.window, cfg.name
        slopes = slopes_for(alibi, 4, q.shape[2])
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                              alibi_slopes=slopes, return_attn_probs=True)
        scale = 128 ** -0.5
        ref, ref_lse = feature_attention(q, k, v, scale, causal, window, softcap, slopes, torch.float64)
        low, _ = feature_attention(q, k, v, scale, causal, window, softcap, slopes, q.dtype)
        what = f"{cfg.name} {sq}x{sk}"
        check_close(out, ref, low, 2, what)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), f"{what}: LSE = +inf rows differ"
        if finite.any():
            assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2, what
        assert (lse[~finite] == math.inf).all(), what
