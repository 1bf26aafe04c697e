"""cuflash.api's host-side behaviour on a machine without a GPU: argument validation (every
error names the argument, and comes before any work), the NoGPUError that points at
cuflash.reference, empty problems that need no GPU at all, and the launch plan's packing
(cuflash.launch.Plan) with the driver calls recorded instead of made."""
import importlib.util
import math
import sys

import numpy as np
import pytest

import cuflash
from cuflash import BwdConfig, ConfigError, FwdConfig, NoGPUError, _gpu, api, flash_attn_func
from cuflash.problem import Problem
from cuflash.select import UnsupportedProblem

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


@pytest.mark.parametrize("headdim", [260, 264, 512])
def test_bad_headdim(headdim):
    q, k, v = qkv(headdim=headdim)
    with pytest.raises(ValueError, match=rf"^q: headdim must be a multiple of 8 in 8\.\.256, got {headdim}$"):
        flash_attn_func(q, k, v)
    # no registered family supports it: the selection error, a ValueError
    with pytest.raises(UnsupportedProblem):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("nheads,nheads_kv", [(4, 3), (3, 2), (2, 4), (1, 0)])
def test_nheads_not_multiple_of_nheads_kv(nheads, nheads_kv):
    q, k, v = qkv(nheads=nheads, nheads_kv=nheads_kv)
    with pytest.raises(ValueError, match=rf"nheads_kv={nheads_kv} must divide q's nheads={nheads}"):
        flash_attn_func(q, k, v)


def test_grid_limits_are_checked():
    q = np.ones((70000, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match=r"^q: batch \(70000\) and nheads"):
        cuflash.flash_attn_func(q, q, q)


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


def test_mixed_numpy_and_torch():
    torch = pytest.importorskip("torch")
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^q, k, v must be the same kind of array, got numpy, torch, numpy"):
        flash_attn_func(q, torch.from_numpy(k), v)


# ---------------------------------------------------------------------------------------
# scalar arguments

@pytest.mark.parametrize("scale", [math.nan, 0, 0.0, -0.125, -math.inf, math.inf])
def test_bad_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^softmax_scale must be a finite number > 0"):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["abc", [1.0], (0.5,), {"s": 1}, True, None.__class__],
                         ids=["str", "list", "tuple", "dict", "bool", "type"])
def test_non_numeric_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^softmax_scale must be a real number or None"):
        flash_attn_func(q, k, v, softmax_scale=scale)


def test_check_scale():
    assert api.check_scale(None, 64) == 0.125
    assert api.check_scale(2, 64) == 2.0 and isinstance(api.check_scale(2, 64), float)
    assert api.check_scale(np.float32(0.5), 64) == 0.5
    assert api.check_scale(np.array(0.25), 64) == 0.25        # a 0-d array holds a number


@pytest.mark.parametrize("kwargs", [
    {"dropout_p": 0.1, "softcap": 1.0}, {"dropout_p": 0.1, "window_size": (4, 4)},
    {"dropout_p": 0.1, "alibi_slopes": np.ones(4, np.float32)},
], ids=["dropout_p_softcap", "dropout_p_window", "dropout_p_alibi"])
def test_dropout_with_features_runs_the_kernels(kwargs):
    """Dropout with window / softcap / ALiBi runs the kernels (fa2_fwd's mixed flags): GPU-kind
    input (NumPy here) needs its dropout_seed, then the GPU (NoGPUError on this machine)."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^dropout_seed: numpy inputs with dropout_p > 0 need"):
        flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(cuflash.NoGPUError, match="flash_attn_func"):
        flash_attn_func(q, k, v, dropout_seed=3, **kwargs)


@pytest.mark.parametrize("kwargs", [{"window_size": (4, 4)}, {"window_size": (3, -1)},
                                    {"softcap": 1.0}, {"alibi_slopes": np.ones(4, np.float32)}],
                         ids=["window_size", "window_size_half", "softcap", "alibi_slopes"])
def test_gpu_features_need_a_gpu(kwargs):
    """Window, softcap and ALiBi are kernel features now: NumPy input is validated, then needs
    the GPU (NoGPUError on this machine)."""
    q, k, v = qkv()
    with pytest.raises(cuflash.NoGPUError, match="flash_attn_func"):
        flash_attn_func(q, k, v, **kwargs)


# ---------------------------------------------------------------------------------------
# config= and bwd_config=

def _config(**changes):
    base = FwdConfig(Br=64, Bc=32, warps=4, stages=2, head_dim=64, dtype="fp16", causal=False)
    return base.replace(**changes)


@pytest.mark.parametrize("bad", [{"Br": 64}, "fwd_fp16_d64_full_Br64_Bc32_w4_s2", (64, 32, 4, 2)],
                         ids=["dict", "str", "tuple"])
def test_config_wrong_type(bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^config: expected a cuflash kernel config \(e\.g\. cuflash\.FwdConfig\)"):
        flash_attn_func(q, k, v, config=bad)
    with pytest.raises(TypeError, match=r"^bwd_config: expected a cuflash kernel config"):
        flash_attn_func(q, k, v, bwd_config=bad)


def test_config_of_the_wrong_op():
    q, k, v = qkv()
    bwd = BwdConfig(32, 128, 4, 2, 1, 64, "fp16", False)
    with pytest.raises(TypeError, match=rf"^config: expected a fwd config, got {bwd.name} \(fa2_bwd, op bwd\)"):
        flash_attn_func(q, k, v, config=bwd)
    with pytest.raises(TypeError, match=r"^bwd_config: expected a bwd config, got fwd_"):
        flash_attn_func(q, k, v, bwd_config=_config())


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


def test_bwd_config_does_not_fit():
    q, k, v = qkv()
    cfg = BwdConfig(32, 128, 4, 2, 1, 48, "fp16", False)
    with pytest.raises(ValueError, match=rf"^bwd_config: {cfg.name} does not fit this call"):
        flash_attn_func(q, k, v, bwd_config=cfg)


def test_invalid_config_rejected_before_launch():
    q, k, v = qkv()
    with pytest.raises(ConfigError, match=r"stages must be >= 2"):
        flash_attn_func(q, k, v, config=_config(stages=1))
    with pytest.raises(ConfigError, match=r"dsplit=3 must divide"):
        flash_attn_func(q, k, v, bwd_config=BwdConfig(32, 128, 4, 2, 3, 64, "fp16", False))


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
def test_no_gpu_error_from_every_api_entry():
    """Every path that needs the GPU says so with NoGPUError, not an import or driver error."""
    with pytest.raises(NoGPUError, match=r"^config_for needs a CUDA GPU"):
        cuflash.config_for(64, "bf16", True)
    with pytest.raises(NoGPUError, match=r"^bwd_config_for needs a CUDA GPU"):
        cuflash.bwd_config_for(64, "bf16", True, deterministic=True)
    for op in ("fwd", "bwd"):
        with pytest.raises(NoGPUError, match=rf"flash_attn \({op}\) needs a CUDA GPU"):
            api.make_plan(Problem(op, "bf16", 1, 8, 8, 1, 1, 64), {}, 0.125, 0)


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


def test_backward_numpy_input_points_to_the_reference():
    q, k, v = qkv(1, 3, 3, 2, 2, 8)
    lse = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(TypeError, match="attention_backward_naive"):
        cuflash.flash_attn_backward(q, q, k, v, q, lse)


def test_backward_bad_input_names_the_argument_numpy():
    q, k, v = qkv(1, 5, 6, 2, 2, 8)
    lse = np.zeros((1, 2, 5), np.float32)
    bwd = cuflash.flash_attn_backward
    with pytest.raises(ValueError, match=r"^dout: expected a numpy array of q's shape"):
        bwd(q[:, :4], q, k, v, q, lse)
    with pytest.raises(ValueError, match=r"^out: expected a numpy array of q's shape"):
        bwd(q, q, k, v, q[..., :4], lse)
    with pytest.raises(ValueError, match=r"^lse: expected a numpy float32 array of shape \(1, 2, 5\)"):
        bwd(q, q, k, v, q, lse[..., :3])
    with pytest.raises(ValueError, match=r"^lse: expected a numpy float32"):
        bwd(q, q, k, v, q, lse.astype(np.float64))
    with pytest.raises(ValueError, match=r"^lse: expected a numpy float32"):
        bwd(q, q, k, v, q, lse.tolist())
    with pytest.raises(TypeError, match=r"^softmax_scale must be a real number"):
        bwd(q, q, k, v, q, lse, softmax_scale="abc")
    with pytest.raises(TypeError, match=r"^config: expected a bwd config"):
        bwd(q, q, k, v, q, lse, config=_config(head_dim=16))


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
    assert isinstance(probs, np.ndarray) and probs.shape == (0,) and probs.dtype == q.dtype


def test_empty_problem_still_validated(no_gpu_allowed):
    q, k, v = qkv(batch=0)
    with pytest.raises(ValueError, match=r"headdim must match"):
        flash_attn_func(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match=r"^dropout_seed: numpy inputs with dropout_p > 0 need"):
        flash_attn_func(q, k, v, dropout_p=0.5)
    with pytest.raises(ValueError, match=r"^q: headdim must be a multiple of 8"):
        flash_attn_func(*qkv(batch=0, headdim=264))


def test_numpy_keyless_input_needs_no_gpu(no_gpu_allowed):
    """seqlen_k == 0: every row is fully masked; the answer (O = 0, LSE = +inf) needs no GPU."""
    q = np.random.default_rng().standard_normal((1, 3, 2, 64)).astype(np.float16)
    k = np.zeros((1, 0, 2, 64), np.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, k, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    assert np.isinf(lse).all() and (lse > 0).all()


def test_public_names():
    for name in ("flash_attn_func", "flash_attn_backward", "FwdConfig", "BwdConfig", "ConfigError",
                 "NoGPUError", "Problem", "reference", "config_for", "bwd_config_for"):
        assert hasattr(cuflash, name), name
    assert issubclass(NoGPUError, RuntimeError)
    assert issubclass(UnsupportedProblem, ValueError)
    assert cuflash.FwdConfig is cuflash.registry.get("fa2_fwd").config_cls
    assert cuflash.BwdConfig is cuflash.registry.get("fa2_bwd").config_cls


def test_importing_cuflash_imports_neither_cupy_nor_torch():
    import subprocess

    code = ("import sys, cuflash, cuflash.api, cuflash.select, cuflash.registry; "
            "cuflash.registry.families(); "
            "print('cupy' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------------------
# layout checks (what the kernels can read in place)

def test_layout_problem():
    t = lambda shape, strides, ptr=0: api._Tensor("cupy", "bf16", shape, strides, ptr, 0)  # noqa: E731
    assert api.layout_problem(t((2, 8, 4, 64), (2048, 256, 64, 1))) == ""
    assert "contiguous" in api.layout_problem(t((2, 8, 4, 64), (2048, 256, 1, 4)))
    assert "multiples of 8" in api.layout_problem(t((2, 8, 4, 64), (2048, 260, 65, 1)))
    assert "aligned" in api.layout_problem(t((2, 8, 4, 64), (2048, 256, 64, 1), ptr=0x1008))
    # a dimension of size 1 may have any stride
    assert api.layout_problem(t((1, 8, 4, 64), (3, 256, 64, 1))) == ""
    assert api.out_strides((2, 3, 4, 5)) == (60, 20, 5, 1)


# ---------------------------------------------------------------------------------------
# the CuPy paths with a fake CuPy (NumPy arrays that say which device they are on)

class _FakeCupy:
    """Just enough of cupy for api's CuPy helpers: arrays on numbered devices, a current
    device that ``with array.device:`` / ``cupy.cuda.Device(i)`` switch, allocation on it."""

    uint8, uint16, float32 = np.uint8, np.uint16, np.float32

    def __init__(self):
        fake = self
        self.current = 0

        class Device:
            def __init__(self, id):
                self.id = id

            def __enter__(self):
                self._saved, fake.current = fake.current, self.id

            def __exit__(self, *exc):
                fake.current = self._saved

        class ndarray:
            def __init__(self, a, device):
                self.a, self._device = a, device

            ndim = property(lambda self: self.a.ndim)
            shape = property(lambda self: self.a.shape)
            dtype = property(lambda self: self.a.dtype)
            strides = property(lambda self: self.a.strides if self.a.size else tuple(  # as CuPy's
                s * self.a.itemsize for s in api.out_strides(self.a.shape)))
            device = property(lambda self: Device(self._device))
            data = property(lambda self: type("MemPtr", (), {"ptr": self.a.ctypes.data,
                                                             "device_id": self._device})())

            def view(self, dtype):
                return ndarray(self.a.view(dtype), self._device)

            def fill(self, value):
                self.a.fill(value)

            def copy(self, order="C"):
                return ndarray(np.array(self.a, order=order), fake.current)

            def __getitem__(self, idx):
                return ndarray(self.a[idx], self._device)

            def __setitem__(self, idx, value):
                assert value._device == self._device == fake.current, "cross-device copy"
                self.a[idx] = value.a

        ndarray.__module__ = "cupy._core.core"
        self.ndarray = ndarray
        self.cuda = type("cuda", (), {"Device": Device, "get_current_stream": staticmethod(
            lambda: type("Stream", (), {"ptr": 7})())})

    def empty(self, shape, dtype):
        a = np.empty(shape, dtype)
        a.view(np.uint8).fill(0xAB)  # uninitialized memory
        return self.ndarray(a, self.current)

    def zeros(self, shape, dtype):
        return self.ndarray(np.zeros(shape, dtype), self.current)

    def ascontiguousarray(self, x):
        return x if x.a.flags.c_contiguous else self.ndarray(np.ascontiguousarray(x.a), self.current)


@pytest.fixture
def fake_cupy(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_gpu, "require", lambda what: None)
    # the validated CuPy backward only: its repeat-call plans (api._bwd_plans, which allocate from
    # CuPy's pool) are tested on the GPU (tests/test_cupy_bwd_fastpath_gpu.py)
    monkeypatch.setattr(api, "_repeat_key", lambda *a, **kw: None)
    monkeypatch.setattr(api, "_bwd_plans", {})
    return fake


def test_head_dim_padding_stays_on_the_arrays_device(fake_cupy):
    x = fake_cupy.ndarray(np.ones((1, 2, 1, 36), np.float16), device=1)   # current device: 0
    padded = api.pad_head_dim(x, 40)
    assert padded.data.device_id == 1 and padded.shape == (1, 2, 1, 40)
    assert (padded.a[..., 36:] == 0).all() and (padded.a[..., :36] == 1).all()
    back = api.slice_head_dim(padded, 36)
    assert back.data.device_id == 1 and back.shape == (1, 2, 1, 36)
    assert fake_cupy.current == 0


def test_cupy_backward_zero_heads_gives_zero_dk_dv(fake_cupy):
    """nheads = 0: q has no elements but k, v (nheads_kv = 1) do; dk, dv are zeros."""
    g = lambda *s: fake_cupy.ndarray(np.ones(s, np.float16), 0)  # noqa: E731
    q, k, v = g(1, 4, 0, 64), g(1, 6, 1, 64), g(1, 6, 1, 64)
    lse = fake_cupy.ndarray(np.zeros((1, 0, 4), np.float32), 0)
    dq, dk, dv = cuflash.flash_attn_backward(q, q, k, v, q, lse)
    assert dk.shape == (1, 6, 1, 64) and not dk.a.any() and not dv.a.any()


def test_cupy_backward_copies_a_misaligned_contiguous_dout(fake_cupy, monkeypatch):
    """A C-contiguous dout whose data starts 2 bytes into its buffer: ascontiguousarray
    would hand the kernel the misaligned array itself; the backward must launch on a copy."""
    launched = []

    class FakePlan:
        workspace_bytes = 256

        def run(self, ptrs, workspace_ptr, stream):
            launched.append(ptrs)

    monkeypatch.setattr(api, "make_plan", lambda *a, **kw: FakePlan())
    monkeypatch.setattr(api, "_feature_plans", {})   # the plan cache: no fake plan outlives the test
    rng = np.random.default_rng(0)
    base = np.zeros(2 * 4 * 2 * 64 + 64, np.float16)
    start = next(i for i in range(1, 64) if (base.ctypes.data + 2 * i) % 16)
    dout_np = base[start:start + 2 * 4 * 2 * 64].reshape(2, 4, 2, 64)
    assert dout_np.flags.c_contiguous and dout_np.ctypes.data % 16
    g = lambda a: fake_cupy.ndarray(a, 0)  # noqa: E731
    q, k, v, out = (g(np.array(rng.standard_normal((2, 4, 2, 64)), np.float16)) for _ in range(4))
    assert all(x.a.ctypes.data % 16 == 0 for x in (q, k, v, out))
    lse = g(np.zeros((2, 2, 4), np.float32))
    api.flash_attn_backward(g(dout_np), q, k, v, out, lse)
    (ptrs,) = launched
    assert ptrs[0] % 16 == 0 and ptrs[0] != dout_np.ctypes.data


def test_fp8_check_traces_under_torch_compile_after_numpy_calls():
    """The e4m3 check caches NumPy dtypes only: a torch dtype never meets that dict, whose
    NumPy keys torch.compile(fullgraph=True) cannot compare (a graph break, i.e. an error)."""
    torch = pytest.importorskip("torch")
    from cuflash import api

    assert not api._is_fp8(np.zeros(2, np.float16))   # NumPy dtypes now in the cache
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert not api._is_fp8(np.zeros(2, ml_dtypes.bfloat16))   # the one dynamo cannot hash
    fn = torch.compile(lambda x: x * 2 if not api._is_fp8(x) else x, fullgraph=True, backend="eager")
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    assert api._is_fp8(torch.zeros(1).to(torch.float8_e4m3fn))


def test_cupy_backward_makes_one_plan_per_call_shape(fake_cupy, monkeypatch):
    """The CuPy backward caches its plan per call shape: a plan made per call zeroed the dynamic
    scheduler's counters with a device synchronization on every call (session 18: 6-27% of a 2k
    backward on the H100). A new shape or causal flag makes a new plan."""
    made, launched = [], []

    class FakePlan:
        workspace_bytes = 256

        def run(self, ptrs, workspace_ptr, stream):
            launched.append(ptrs)

    def fake_make_plan(problem, strides, scale, device, config=None):
        made.append(problem)
        return FakePlan()

    monkeypatch.setattr(api, "make_plan", fake_make_plan)
    monkeypatch.setattr(api, "_feature_plans", {})
    rng = np.random.default_rng(1)
    g = lambda *s: fake_cupy.ndarray(np.array(rng.standard_normal(s), np.float16), 0)  # noqa: E731
    q, k, v, out, dout = (g(2, 4, 2, 64) for _ in range(5))
    lse = fake_cupy.ndarray(np.zeros((2, 2, 4), np.float32), 0)
    for _ in range(3):
        api.flash_attn_backward(dout, q, k, v, out, lse)
    assert len(made) == 1 and len(launched) == 3
    api.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    q2, k2, v2, out2, dout2 = (g(1, 4, 2, 64) for _ in range(5))
    api.flash_attn_backward(dout2, q2, k2, v2, out2, fake_cupy.ndarray(np.zeros((1, 2, 4), np.float32), 0))
    assert len(made) == 3 and made[1].causal and made[2].batch == 1
