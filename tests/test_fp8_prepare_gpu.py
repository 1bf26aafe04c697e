"""sm90_fwd_fp8's prepare kernel on an H100: the Vᵀ and descales it writes into the launch's
workspace, byte for byte against the NumPy mirrors (cuflash.fp8.vt_mirror, descale_mirror).

Each case runs the family's plan (prepare, then main) through cuflash.fp8.run_plan on a
workspace poisoned with 0xEE, synchronizes and reads the workspace back. Compiles: the
non-causal heuristic configs of head dims 64, 128 and 256 (three modules, the ones
test_fp8_gpu.py also builds). Run first: `-k vt` (layout), then test_fp8_gpu.py.
"""
import math

import numpy as np
import pytest

from cuflash import fp8, launch, registry
from cuflash.families.sm90_fwd_fp8 import vt_shape
from cuflash.problem import Problem

pytestmark = [pytest.mark.gpu]

FAM = registry.get("sm90_fwd_fp8")


def require_sm90():
    from cuflash import _gpu

    if not _gpu.available() or _gpu.arch() != (9, 0):
        pytest.skip("sm90_fwd_fp8 needs an sm_90 GPU")


def _torch():
    import torch

    return torch


def run_prepare(q8, k8, v8, descales):
    """(Vᵀ bytes, (q, k, v) descales) as the prepare kernel wrote them, and the workspace."""
    torch = _torch()
    b, sq, h, d = q8.shape
    sk, hkv = k8.shape[1], k8.shape[2]
    p = Problem("fwd", "e4m3", b, sq, sk, h, hkv, d, False)
    cfg = FAM.heuristic(p)
    out = torch.empty((b, sq, h, d), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((b, h, sq), dtype=torch.float32, device="cuda")
    strides = {"q": q8.stride(), "k": k8.stride(), "v": v8.stride(), "o": out.stride()}
    plan = launch.Plan(FAM, cfg, p, strides, 1 / math.sqrt(d), 0)
    ws_off = FAM.workspace(cfg, p)
    ws = torch.full((plan.workspace_bytes,), 0xEE, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    keep = fp8.run_plan(plan, (q8.data_ptr(), k8.data_ptr(), v8.data_ptr(), out.data_ptr(),
                               lse.data_ptr()), ws.data_ptr(), descales, "torch", stream)
    torch.cuda.synchronize()
    del keep
    host = ws.cpu().numpy()
    n = b * hkv
    ds = tuple(host[ws_off[name]:ws_off[name] + 4 * n].view(np.float32).reshape(b, hkv)
               for name in ("q_descale", "k_descale", "v_descale"))
    vt = host[ws_off["vt"]:ws_off["vt"] + int(np.prod(vt_shape(p)))].reshape(vt_shape(p))
    return vt, ds, out


def e4m3_bytes(shape, g):
    torch = _torch()
    return (torch.randn(*shape, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)


def check(v8, hq=4, sq=33, descales=(None, None, None)):
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(1)
    b_, sk, hkv, d = v8.shape
    q8 = e4m3_bytes((b_, sq, hq, d), g)
    k8 = e4m3_bytes((b_, sk, hkv, d), g)
    vt, ds, _ = run_prepare(q8, k8, v8, descales)
    want = fp8.vt_mirror(v8.view(torch.uint8).cpu().numpy())
    bad = np.argwhere(vt != want)
    assert bad.size == 0, (f"{len(bad)} wrong Vᵀ bytes of {vt.size}; first (b, h, col, pos): "
                           f"{bad[:6].tolist()}; got {vt[tuple(bad[0])]:#x} want {want[tuple(bad[0])]:#x}")
    for name, got, d_in in zip("qkv", ds, descales):
        host = None if d_in is None else d_in.cpu().numpy()
        assert np.array_equal(got, fp8.descale_mirror(host, b_, hkv)), (name, got)


@pytest.mark.parametrize("sk", [1, 17, 113, 1023, 2049])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_vt_contiguous(d, sk):
    require_sm90()
    g = _torch().Generator(device="cuda").manual_seed(sk + d)
    check(e4m3_bytes((2, sk, 2, d), g), hq=4)


@pytest.mark.parametrize("d", [48, 80, 160])
def test_vt_smaller_head_dims(d):
    """Head dims below the config's (64 / 128 / 256): only the real rows of Vᵀ are written."""
    require_sm90()
    g = _torch().Generator(device="cuda").manual_seed(d)
    check(e4m3_bytes((1, 113, 1, d), g), hq=3)                   # MQA


def test_vt_strided_v():
    """V as a slice of a packed KV tensor (16-byte aligned rows: the vector path), V with a
    column stride of 2 and V at an odd address (the byte path)."""
    require_sm90()
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(7)
    kv = e4m3_bytes((2, 1023, 2, 2, 128), g)
    check(kv[:, :, 1], hq=4)                                     # (2, 1023, 2, 128), row stride 512
    wide = e4m3_bytes((2, 113, 2, 256), g)
    check(wide[..., ::2], hq=2)                                  # column stride 2
    odd = e4m3_bytes((2, 113, 2, 129), g)
    check(odd[..., 1:], hq=2)                                    # address + 1 byte, rows of 129


def test_descales_forms():
    """None (1), one value, (batch, nheads_kv), and a non-contiguous (batch, nheads_kv)."""
    require_sm90()
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(3)
    v8 = e4m3_bytes((3, 17, 2, 64), g)
    per = torch.rand(3, 2, device="cuda", generator=g) + 0.5
    strided = (torch.rand(2, 3, device="cuda", generator=g) + 0.5).t()
    check(v8, hq=4, descales=(torch.tensor([0.25], device="cuda"), per, None))
    check(v8, hq=4, descales=(None, torch.tensor(2.0, device="cuda"), strided))


def test_strided_v_same_output():
    """flash_attn_func with a strided V (both prepare paths) equals the call with V contiguous."""
    require_sm90()
    torch = _torch()
    import cuflash

    g = torch.Generator(device="cuda").manual_seed(11)
    q8 = e4m3_bytes((2, 300, 4, 128), g)
    k8 = e4m3_bytes((2, 257, 2, 128), g)
    wide = e4m3_bytes((2, 257, 2, 256), g)
    for v8 in (wide[..., ::2], wide[..., 5:133]):
        a = cuflash.flash_attn_func(q8, k8, v8, causal=True)
        c = cuflash.flash_attn_func(q8, k8, v8.contiguous(), causal=True)
        assert torch.equal(a, c)


def test_repeat_calls_take_the_hot_path(monkeypatch):
    """Outputs not poisoned: the second call of a shape takes fp8's hot path (no checks) and
    gives the first call's answer; new descale values (same shapes) and new tensors are read
    per call; a misaligned q goes back to the checks (which refuse it)."""
    require_sm90()
    torch = _torch()
    import cuflash
    from cuflash import api

    monkeypatch.setattr(api, "POISON_OUTPUTS", False)
    g = torch.Generator(device="cuda").manual_seed(5)
    q8, k8, v8 = e4m3_bytes((2, 200, 4, 128), g), e4m3_bytes((2, 150, 2, 128), g), e4m3_bytes((2, 150, 2, 128), g)
    qd, kd = torch.rand(2, 2, device="cuda", generator=g) + 0.5, torch.tensor([0.75], device="cuda")
    fp8._fast.clear()
    first, lse1, _ = cuflash.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                             return_attn_probs=True)
    assert len(fp8._fast) == 1
    calls = []
    monkeypatch.setattr(fp8, "check_fp8_qkv", lambda *a: calls.append(a) or pytest.fail("checked"))
    again, lse2, _ = cuflash.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                             return_attn_probs=True)
    assert torch.equal(first, again) and torch.equal(lse1, lse2) and not calls
    kd2 = kd * 2
    v2 = e4m3_bytes((2, 150, 2, 128), g)
    hot = cuflash.flash_attn_func(q8, k8, v2, causal=True, q_descale=qd, k_descale=kd2)
    monkeypatch.undo()
    monkeypatch.setattr(api, "POISON_OUTPUTS", True)
    cold = cuflash.flash_attn_func(q8, k8, v2, causal=True, q_descale=qd, k_descale=kd2)
    assert torch.equal(hot, cold) and not torch.equal(hot, first)
    monkeypatch.setattr(api, "POISON_OUTPUTS", False)
    buf = torch.empty(q8.numel() + 16, dtype=torch.uint8, device="cuda")
    q_odd = buf[1:1 + q8.numel()].view(torch.float8_e4m3fn).view(q8.shape)
    with pytest.raises(ValueError, match="^q: TMA needs 16-byte aligned rows"):
        cuflash.flash_attn_func(q_odd, k8, v8, causal=True, q_descale=qd, k_descale=kd)
