"""flash_attn_with_kvcache on NumPy arrays, without a GPU: validation on the host (int values
included), the copies to and from the device, and the in-place append reflected into the
caller's k_cache / v_cache, with a fake CuPy and a fake decode entry that runs the float64
reference on the device copies (what the kernels compute; tests/test_decode_gpu.py checks
the kernels themselves)."""
import sys
import types

import numpy as np
import pytest

from cuflash import _gpu, decode, reference
from cuflash.decode import flash_attn_with_kvcache


class _Dev(np.ndarray):
    """A NumPy array posing as a CuPy one (address, device id)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self):
        return types.SimpleNamespace(id=0)


def _fake_cupy():
    return types.SimpleNamespace(
        ndarray=_Dev, float32=np.float32, uint8=np.uint8, uint16=np.uint16,
        asarray=lambda a: np.array(a).view(_Dev), asnumpy=lambda a: np.array(a).view(np.ndarray),
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0)))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Fake CuPy and decode entry: run() computes the reference on the device copies (raw
    uint16 words of fp16), updating the device caches in place as the kernels do."""
    runs = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(_gpu, "require", lambda what: None)

    def gpu_entry(args, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                  num_splits, config=None, arrays=None, call=None):
        assert call is not None and call.tq.kind == "cupy" and call.tq.dtype == "fp16"
        assert all(x is None or not isinstance(x, np.ndarray) or isinstance(x, _Dev) for x in args)

        def run(dev):
            runs.append(dev)
            def h(x):  # raw fp16 words -> float64
                return None if x is None else np.asarray(x).view(np.float16).astype(np.float64)

            def ints(x):
                return None if x is None or isinstance(x, int) else np.asarray(x).astype(np.int64)

            q, kc, vc, k, v, cos, sin, lens, idx, pad, table, slopes = dev
            out, lse, k_new, v_new = reference.attention_kvcache(
                h(q), h(kc), h(vc), lens if isinstance(lens, int) else ints(lens), h(k), h(v),
                rotary_cos=h(cos), rotary_sin=h(sin), rotary_interleaved=rotary_interleaved,
                cache_batch_idx=ints(idx), cache_leftpad=ints(pad), block_table=ints(table),
                softmax_scale=call.softmax_scale, causal=bool(causal),
                window_size=tuple(window_size), softcap=call.softcap,
                alibi_slopes=None if slopes is None else np.asarray(slopes, np.float64))
            if call.seqlen_new:
                kc[...] = k_new.astype(np.float16).view(np.uint16)
                vc[...] = v_new.astype(np.float16).view(np.uint16)
            return (out.astype(np.float16).view(np.uint16).view(_Dev),
                    lse.astype(np.float32).view(_Dev))

        return types.SimpleNamespace(run=run)

    monkeypatch.setattr(decode, "_gpu_entry", gpu_entry)
    return runs


def _problem(seed=0, batch=3, sq=2, cap=12, h=4, hkv=2, d=8, new=2, strided=False):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    kc, vc = r(batch, cap, hkv, 2 * d)[..., :d] if strided else r(batch, cap, hkv, d), r(batch, cap, hkv, d)
    return dict(q=r(batch, sq, h, d), k_cache=kc, v_cache=vc, k=r(batch, new, hkv, d),
                v=r(batch, new, hkv, d), cache_seqlens=np.array([0, 3, 10], np.int32))


def _want(args, **kw):
    h = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    return reference.attention_kvcache(h(args["q"]), h(args["k_cache"]), h(args["v_cache"]),
                                       args["cache_seqlens"].astype(np.int64), h(args["k"]),
                                       h(args["v"]), **kw)


@pytest.mark.parametrize("strided", [False, True])
def test_numpy_append_is_reflected_into_the_callers_cache(fake_gpu, strided):
    args = _problem(strided=strided)
    want_o, want_l, want_k, want_v = _want(args, causal=True)
    kc, vc = args["k_cache"], args["v_cache"]
    out, lse = flash_attn_with_kvcache(**args, causal=True, return_softmax_lse=True)
    assert isinstance(out, np.ndarray) and type(out) is np.ndarray and out.dtype == np.float16
    assert out.shape == args["q"].shape and lse.shape == (3, 4, 2) and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float64), want_o, atol=2e-3)
    np.testing.assert_allclose(lse, want_l, rtol=1e-5)
    assert args["k_cache"] is kc and args["v_cache"] is vc          # the caller's arrays, in place
    np.testing.assert_array_equal(kc, want_k.astype(np.float16))
    np.testing.assert_array_equal(vc, want_v.astype(np.float16))
    assert len(fake_gpu) == 1


def test_numpy_without_append_leaves_the_cache_and_returns_out(fake_gpu):
    args = dict(_problem(), k=None, v=None)
    kc0 = args["k_cache"].copy()
    out = flash_attn_with_kvcache(**args)
    assert type(out) is np.ndarray and out.shape == args["q"].shape
    np.testing.assert_array_equal(args["k_cache"], kc0)


def test_numpy_paged_rotary_and_features(fake_gpu):
    rng = np.random.default_rng(3)
    args = _problem(seed=3)
    kc = rng.standard_normal((5, 6, 2, 8)).astype(np.float16)
    vc = rng.standard_normal((5, 6, 2, 8)).astype(np.float16)
    table = np.array([[4, 0], [1, 3], [2, 4]], np.int32)[:, ::-1]   # strided: copied dense
    cos = rng.standard_normal((12, 3)).astype(np.float16)
    sin = rng.standard_normal((12, 3)).astype(np.float16)
    args.update(k_cache=kc, v_cache=vc, block_table=table, rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=np.array([1, 4, 10], np.int32))
    kw = dict(causal=True, softcap=3.0, alibi_slopes=np.ones(4, np.float32))
    out = flash_attn_with_kvcache(**args, **kw)
    h = lambda x: np.asarray(x, np.float64)  # noqa: E731
    want_o, _, want_k, _ = reference.attention_kvcache(
        h(args["q"]), h(kc.copy()), h(vc.copy()), np.array([1, 4, 10]), h(args["k"]), h(args["v"]),
        rotary_cos=h(cos), rotary_sin=h(sin), block_table=table.astype(np.int64), causal=True,
        softcap=3.0, alibi_slopes=np.ones(4))
    np.testing.assert_allclose(out.astype(np.float64), want_o, atol=5e-3)
    np.testing.assert_allclose(kc.astype(np.float64), want_k, atol=2e-3)


def test_numpy_values_are_checked_on_the_host(fake_gpu):
    with pytest.raises(ValueError, match=r"^cache_seqlens: must lie in \[0, 10\]"):
        flash_attn_with_kvcache(**dict(_problem(), cache_seqlens=np.array([0, 3, 11], np.int32)))
    args = _problem()
    args.update(block_table=np.array([[0, 1], [1, 2], [2, 7]], np.int32),
                k_cache=np.zeros((4, 6, 2, 8), np.float16), v_cache=np.zeros((4, 6, 2, 8), np.float16))
    with pytest.raises(ValueError, match=r"^block_table: the entries in use must index"):
        flash_attn_with_kvcache(**args)
    with pytest.raises(ValueError, match=r"^cache_batch_idx: must index"):
        flash_attn_with_kvcache(**dict(_problem(), cache_batch_idx=np.array([0, 1, 5], np.int32)))
    assert not fake_gpu


def test_numpy_read_only_or_aliased_cache_is_refused_before_any_launch(fake_gpu):
    args = _problem()
    args["k_cache"].setflags(write=False)
    with pytest.raises(ValueError, match=r"^k_cache: a read-only NumPy array"):
        flash_attn_with_kvcache(**args)
    args = _problem()
    args["v_cache"] = args["k_cache"]
    with pytest.raises(ValueError, match=r"^v_cache: shares memory with k_cache"):
        flash_attn_with_kvcache(**args)
    args = dict(_problem(), k=None, v=None)
    args["k_cache"].setflags(write=False)             # no append: read-only is fine
    flash_attn_with_kvcache(**args)
    assert len(fake_gpu) == 1


def test_numpy_empty_batch_needs_no_gpu(monkeypatch):
    monkeypatch.setattr(_gpu, "require", lambda what: pytest.fail("reached the GPU"))
    args = _problem()
    args = {k: (v[:0] if isinstance(v, np.ndarray) and k not in ("k_cache", "v_cache") else v)
            for k, v in args.items()}
    out, lse = flash_attn_with_kvcache(**args, return_softmax_lse=True)
    assert out.shape == (0, 2, 4, 8) and lse.shape == (0, 4, 2)
