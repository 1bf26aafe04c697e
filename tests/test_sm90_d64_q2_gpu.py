"""sm90_fwd's d64 causal heuristic of the 2048 bucket (HEURISTIC_D64_Q_DOUBLE, session 16: the 3-consumer
tile with two Q buffers) on the GPU, the FlashAttention way: the kernel selection gives, over s_q != s_k
both ways and GQA / MQA in that bucket, against the float64 reference (2x plain attention's error in the
same precision), and bit for bit against the same tile without q_double. 4 compiles
(tests/sm90_fwd_cells_timing.py --with-tests compiles them in parallel):
    CUDA_LAUNCH_BLOCKING=1 timeout 200 python -m pytest -q tests/test_sm90_d64_q2_gpu.py
"""
import pytest

from test_features_gpu import inputs  # noqa: E402
from test_sm90_fwdnc_gpu import check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


Q2_SHAPES = [(2049, 1023, "gqa"), (1023, 2049, "mqa"), (2049, 2049, "mha"), (1500, 2049, "gqa")]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_d64_causal_heuristic_with_q_double(dtype):
    import torch

    k = (dtype, 64, True, {})
    for sq, sk, heads in Q2_SHAPES:
        q, kk, v, _ = inputs(2, sq, sk, heads, 64, dtype)
        cfg, out, lse = check(k, q, kk, v, f"{sq}x{sk} {heads}")
        assert cfg.q_double and cfg.consumers == 3 and cfg.causal, cfg.name
        cfg2, out2, lse2 = check((dtype, 64, True, {"q_double": False}), q, kk, v, "without q_double")
        assert cfg2 == cfg.replace(q_double=False)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{cfg.name}: differs from {cfg2.name}"
