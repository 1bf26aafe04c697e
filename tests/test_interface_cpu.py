"""flash_attn_func's host-side behaviour on a machine without a GPU: argument validation
(every error names the argument), the NoGPUError that points at cuflash.reference, and
empty problems that need no GPU at all."""
import importlib.util
import math
import sys

import numpy as np
import pytest

import cuflash
from cuflash import ConfigError, FwdConfig, NoGPUError, _gpu, flash_attn_func

HAS_CUPY = importlib.util.find_spec("cupy") is not None
needs_no_gpu = pytest.mark.skipif(_gpu.available(), reason="a CUDA GPU is usable here: "
                                  "the no-GPU error path cannot be reached")
needs_cupy = pytest.mark.skipif(not HAS_CUPY, reason="CuPy is not importable")


def qkv(batch=2, seqlen_q=5, seqlen_k=7, nheads=4, nheads_kv=2, headdim=64, dtype=np.float16):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads_kv, headdim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads_kv, headdim)).astype(dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------
# shapes

def test_wrong_ndim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^q: expected 4 dimensions"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match=r"^k: expected 4 dimensions"):
        flash_attn_func(q, k[None], v)
    with pytest.raises(ValueError, match=r"^v: expected 4 dimensions"):
        flash_attn_func(q, k, v[:, :, 0])


def test_mismatched_batch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k, v: batch must match q's 2, got 1 and 2"):
        flash_attn_func(q, k[:1], v)
    with pytest.raises(ValueError, match=r"k, v: batch must match q's 2, got 2 and 1"):
        flash_attn_func(q, k, v[:1])


def test_mismatched_headdim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"headdim must match q's 64, got 32 and 32"):
        flash_attn_func(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match=r"headdim must match q's 64, got 64 and 32"):
        flash_attn_func(q, k, v[..., :32])


def test_k_v_shape_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^v: shape must equal k's"):
        flash_attn_func(q, k, v[:, :6])          # seqlen_k differs
    with pytest.raises(ValueError, match=r"^v: shape must equal k's"):
        flash_attn_func(q, k, v[:, :, :1])       # nheads_kv differs


@pytest.mark.parametrize("headdim", [60, 4, 12, 264, 512])
def test_bad_headdim(headdim):
    q, k, v = qkv(headdim=headdim)
    with pytest.raises(ValueError, match=rf"headdim must be a multiple of 8 in 8\.\.256, got {headdim}"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("nheads,nheads_kv", [(4, 3), (3, 2), (2, 4), (1, 0)])
def test_nheads_not_multiple_of_nheads_kv(nheads, nheads_kv):
    q, k, v = qkv(nheads=nheads, nheads_kv=nheads_kv)
    with pytest.raises(ValueError, match=rf"nheads_kv={nheads_kv} must divide q's nheads={nheads}"):
        flash_attn_func(q, k, v)


# ---------------------------------------------------------------------------------------
# dtypes and kinds

@pytest.mark.parametrize("bad", [np.float32, np.float64, np.int16])
def test_unsupported_dtype(bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^q: dtype must be float16 or bfloat16"):
        flash_attn_func(q.astype(bad), k, v)
    with pytest.raises(TypeError, match=r"^v: dtype must be float16 or bfloat16"):
        flash_attn_func(q, k, v.astype(bad))


def test_dtype_mismatch():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        flash_attn_func(q, k.astype(ml_dtypes.bfloat16), v)
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        flash_attn_func(q.astype(ml_dtypes.bfloat16), k, v)


def test_mixed_kinds():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^k: expected a CuPy array, NumPy array or torch tensor, got list"):
        flash_attn_func(q, k.tolist(), v)
    with pytest.raises(TypeError, match=r"^q: expected .* got tuple"):
        flash_attn_func(tuple(q.tolist()), k, v)


# ---------------------------------------------------------------------------------------
# scalar arguments

@pytest.mark.parametrize("scale", [math.nan, 0, 0.0, -0.125, -math.inf, math.inf])
def test_bad_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite number > 0"):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("kwargs,pattern", [
    ({"dropout_p": 0.1}, r"dropout_p=0\.1: dropout is not implemented"),
    ({"window_size": (4, 4)}, r"window_size=\(4, 4\): sliding window is not implemented"),
    ({"window_size": (-1, 0)}, r"window_size="),
    ({"softcap": 1.0}, r"softcap=1\.0: softcapping is not implemented"),
    ({"alibi_slopes": np.ones(2)}, r"alibi_slopes: ALiBi is not implemented"),
], ids=["dropout_p", "window_size", "window_size_half", "softcap", "alibi_slopes"])
def test_unimplemented_features(kwargs, pattern):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=pattern):
        flash_attn_func(q, k, v, **kwargs)


# ---------------------------------------------------------------------------------------
# config=

def _config(**changes):
    base = FwdConfig(Br=64, Bc=32, warps=4, stages=2, head_dim=64, dtype="fp16", causal=False)
    return base.replace(**changes)


@pytest.mark.parametrize("bad", [{"Br": 64}, "fwd_fp16_d64_full_Br64_Bc32_w4_s2", (64, 32, 4, 2)])
def test_config_wrong_type(bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^config: expected a cuflash\.FwdConfig"):
        flash_attn_func(q, k, v, config=bad)


@pytest.mark.parametrize("changes,causal", [
    ({"dtype": "bf16"}, False),     # dtype differs from the inputs'
    ({}, True),                     # causal differs from the call's
    ({"causal": True}, False),
    ({"head_dim": 48}, False),      # compiled head dim smaller than the inputs'
], ids=["dtype", "causal_call", "causal_config", "head_dim"])
def test_config_does_not_fit(changes, causal):
    q, k, v = qkv()
    cfg = _config(**changes)
    with pytest.raises(ValueError, match=rf"^config: {cfg.name} does not fit this call"):
        flash_attn_func(q, k, v, causal=causal, config=cfg)


def test_invalid_config_rejected_before_launch():
    q, k, v = qkv()
    with pytest.raises(ConfigError, match=r"stages must be >= 2"):
        flash_attn_func(q, k, v, config=_config(stages=1))


# ---------------------------------------------------------------------------------------
# no GPU: valid input reaches the launch and raises NoGPUError

@needs_no_gpu
@pytest.mark.parametrize("shape", [
    dict(),                                                  # GQA, 4 heads over 2
    dict(nheads=4, nheads_kv=1, headdim=8),                  # MQA, smallest head dim
    dict(batch=1, seqlen_q=1, seqlen_k=1, nheads=1, nheads_kv=1, headdim=256),
    dict(seqlen_q=9, seqlen_k=3, headdim=72),                # seqlen_q > seqlen_k
])
@pytest.mark.parametrize("causal", [False, True])
def test_valid_input_raises_no_gpu_error(shape, causal):
    q, k, v = qkv(**shape)
    with pytest.raises(NoGPUError, match=r"cuflash\.reference\.attention_naive") as info:
        flash_attn_func(q, k, v, causal=causal)
    assert isinstance(info.value, RuntimeError)
    assert "flash_attn_func needs a CUDA GPU" in str(info.value)


@needs_no_gpu
def test_valid_input_with_config_raises_no_gpu_error():
    q, k, v = qkv(headdim=40)
    cfg = _config(head_dim=48, causal=True)
    with pytest.raises(NoGPUError, match=r"cuflash\.reference"):
        flash_attn_func(q, k, v, causal=True, softmax_scale=0.5, config=cfg, return_attn_probs=True)


@needs_no_gpu
def test_bf16_numpy_passes_validation():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = qkv(dtype=ml_dtypes.bfloat16)
    assert q.dtype == ml_dtypes.bfloat16
    with pytest.raises(NoGPUError, match=r"cuflash\.reference"):
        flash_attn_func(q, k, v, causal=True)
    with pytest.raises(NoGPUError):
        flash_attn_func(q, k, v, config=_config(dtype="bf16"))


@needs_no_gpu
@needs_cupy
def test_no_gpu_error_gives_cupys_reason():
    # CuPy imports, but the driver / device check fails: the message says which.
    reason = _gpu.why_unavailable()
    assert reason and not _gpu.available()
    assert "CuPy is not importable" not in reason
    q, k, v = qkv()
    with pytest.raises(NoGPUError) as info:
        flash_attn_func(q, k, v)
    assert reason in str(info.value)


# ---------------------------------------------------------------------------------------
# empty problems: answered on the host, no GPU and no CuPy involved

@pytest.fixture
def no_gpu_allowed(monkeypatch):
    """Make any use of CuPy or of the GPU check fail loudly."""
    monkeypatch.setitem(sys.modules, "cupy", None)           # `import cupy` -> ImportError

    def forbidden(what):
        raise AssertionError(f"{what} asked for a GPU on an empty problem")

    monkeypatch.setattr(_gpu, "require", forbidden)


def _dtypes():
    out = [np.float16]
    try:
        import ml_dtypes
    except ImportError:
        return out
    return out + [ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [
    dict(batch=0),
    dict(seqlen_q=0),
    dict(batch=0, seqlen_q=0, seqlen_k=0),
    dict(seqlen_q=0, seqlen_k=0),
], ids=["batch0", "seqlen_q0", "all0", "seqlen_qk0"])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_problem_needs_no_gpu(no_gpu_allowed, dtype, shape, causal):
    q, k, v = qkv(dtype=dtype, **shape)
    out = flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, np.ndarray)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.size == 0

    out, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    batch, seqlen_q, nheads, _ = q.shape
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == np.float32
    assert probs is None


def test_empty_problem_still_validated(no_gpu_allowed):
    q, k, v = qkv(batch=0)
    with pytest.raises(ValueError, match=r"headdim must match"):
        flash_attn_func(q, k[..., :32], v[..., :32])
    with pytest.raises(NotImplementedError, match=r"dropout_p"):
        flash_attn_func(q, k, v, dropout_p=0.5)


def test_public_names():
    for name in ("flash_attn_func", "FwdConfig", "ConfigError", "NoGPUError", "reference",
                 "default_fwd_config", "config_for", "flash_attn_backward", "BwdConfig",
                 "bwd_config_for", "default_bwd_config"):
        assert hasattr(cuflash, name), name
    assert issubclass(NoGPUError, RuntimeError)


def test_numpy_keyless_input_needs_no_gpu():
    """seqlen_k == 0: every row is fully masked; the answer (O = 0, LSE = +inf) needs no GPU."""
    q = np.random.default_rng().standard_normal((1, 3, 2, 64)).astype(np.float16)
    k = np.zeros((1, 0, 2, 64), np.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, k, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert np.isinf(lse).all() and (lse > 0).all()


def test_grid_limits_are_checked():
    q = np.ones((70000, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match="batch"):
        cuflash.flash_attn_func(q, q, q)


def test_backward_launch_plumbing_without_a_gpu(monkeypatch):
    """_backward_on_device up to the launches: grids, the head group, every BwdParams field."""
    import contextlib

    import numpy as np

    from cuflash import _gpu, interface as itf
    from cuflash.config import default_bwd_config

    launches = []
    monkeypatch.setattr(itf, "get_kernels", lambda c, d: {r: r for r in c.kernel_names()})
    monkeypatch.setattr(itf, "_launch", lambda k, grid, threads, smem, stream, params:
                        launches.append((k, grid, int(params["head_group"][0]))))
    monkeypatch.setattr(itf, "_on_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_gpu, "sm_count", lambda device=0: 132)

    def tensor(shape):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(4))
        return itf._Tensor(kind="torch", dtype="bf16", shape=shape, strides=strides, ptr=256, device=0)

    q, k = tensor((2, 300, 8, 128)), tensor((2, 300, 2, 128))
    cfg = default_bwd_config(128, "bf16", False)
    ws = itf.bwd_workspace(2, 8, 300, 300, True, cfg)
    itf._backward_on_device(q, q, k, k, q, 0, q, k, k, 1024, ws, 0.1, False, cfg, 0, 0)
    kv_ctas = -(-300 // cfg.Bc) * cfg.dsplit
    assert [name for name, _, _ in launches] == ["preprocess", "main", "convert_dq", "reduce_dkv"]
    assert launches[1][1] == (16 * kv_ctas, 1, 1)
    assert launches[1][2] == itf.bwd_head_group(16, kv_ctas, 132) == 16


def test_bwd_head_group():
    from cuflash.interface import bwd_head_group

    assert bwd_head_group(pairs=16, kv_ctas=128, sms=132) == 3     # 16k: three heads, 384 CTAs
    assert bwd_head_group(pairs=128, kv_ctas=16, sms=132) == 17    # 2k
    assert bwd_head_group(pairs=4, kv_ctas=16, sms=132) == 4       # never more than there are
    assert bwd_head_group(pairs=8, kv_ctas=10 ** 6, sms=132) == 1
