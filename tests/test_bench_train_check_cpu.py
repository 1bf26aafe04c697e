"""cuflash.train_check without a GPU: the task's data, the loss-curve comparison, the same
initial weights for every attention, tiny CPU training runs (SDPA; cuflash through its NumPy
reference), and NoGPUError for --device cuda without a GPU."""
import json
import math

import pytest

from cuflash import _gpu

torch = pytest.importorskip("torch")
from cuflash import train_check  # noqa: E402 - needs torch

try:
    import matplotlib  # noqa: F401
    HAS_MPL = True
except ImportError:
    HAS_MPL = False



def test_batches_are_deterministic_and_periodic():
    table = train_check.walk_table(64, 4, seed=3)
    assert table.shape == (64, 4)
    assert torch.equal(table, train_check.walk_table(64, 4, seed=3))
    a = train_check.make_batch(5, 8, 100, table, 3, 8, 32)
    b = train_check.make_batch(5, 8, 100, table, 3, 8, 32)
    c = train_check.make_batch(6, 8, 100, table, 3, 8, 32)
    assert a.shape == (8, 101) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < 64
    for row in a:
        # the smallest period that repeats the row lies in 8..32
        p = next(p for p in range(1, 33) if torch.equal(row[p:], row[:-p]))
        assert 1 <= p <= 32
        # consecutive tokens within a period follow the walk graph
        for t in range(min(p, 100) - 1):
            if t + 1 < p:
                assert int(row[t + 1]) in table[int(row[t])].tolist()


def test_smooth():
    assert train_check.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert train_check.smooth([2.0], 10) == [2.0]


def _runs(ref, cand, noise=None):
    runs = {"cuflash": dict(loss=cand), "sdpa_flash": dict(loss=ref)}
    if noise is not None:
        runs["sdpa_efficient"] = dict(loss=noise)
    return runs


def test_compare_pass_and_fail():
    ref = [5.0 * math.exp(-i / 40) + 0.5 for i in range(300)]
    close = [x * 1.003 for x in ref]
    noise = [x * 0.9999 for x in ref]
    res = train_check.compare(_runs(ref, close, noise), "cuflash", "sdpa_flash", "sdpa_efficient",
                              vocab=512, window=25)
    assert res["pass"] and res["finite"] and res["final_ok"] and res["curve_ok"]
    final_ref = res["final_smoothed"]["sdpa_flash"]
    assert res["tol_final"] == pytest.approx(max(5 * res["noise_final_diff"], 0.01 * final_ref, 0.005))
    assert res["final_diff_over_noise"] == pytest.approx(30, rel=1e-6)
    # 3 % off at the end: fails the final check (tol 1 %), passes the curve (2 % + 0.005)
    off = [x * 1.03 for x in ref]
    res = train_check.compare(_runs(ref, off, noise), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 25)
    assert not res["pass"] and not res["final_ok"]
    # a model that stops learning halfway: fails the final and the curve checks
    stuck = ref[:150] + [ref[150]] * 150
    res = train_check.compare(_runs(ref, stuck, noise), "cuflash", "sdpa_flash", "sdpa_efficient",
                              vocab=512, window=25)
    assert not res["pass"] and not res["final_ok"] and not res["curve_ok"]
    # a bump mid-curve that recovers: only the curve check catches it
    bump = [x * (1.2 if 100 <= i < 140 else 1.0) for i, x in enumerate(ref)]
    res = train_check.compare(_runs(ref, bump, noise), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 25)
    assert res["final_ok"] and not res["curve_ok"] and not res["pass"]
    # a noisy reference widens the tolerances
    wide = [x * 1.02 for x in ref]
    res = train_check.compare(_runs(ref, off, wide), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 25)
    assert res["pass"]
    # a NaN fails
    nan = ref[:-1] + [math.nan]
    assert not train_check.compare(_runs(ref, nan), "cuflash", "sdpa_flash", None, 512, 25)["pass"]


def test_compare_init_check():
    ref = [1.0] * 50
    init = {"cuflash": dict(loss=1.0, loss_diff=2e-5, grad_cos=0.999998, grad_rel_l2=3e-3),
            "sdpa_flash": dict(loss=1.0, loss_diff=0.0, grad_cos=1.0, grad_rel_l2=0.0),
            "sdpa_efficient": dict(loss=1.0, loss_diff=1e-5, grad_cos=0.999998, grad_rel_l2=2e-3)}
    res = train_check.compare(_runs(ref, ref, ref), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 5, init)
    assert res["init_ok"] and res["pass"]
    assert res["init_tol_grad_rel_l2"] == pytest.approx(6e-3)
    init["cuflash"]["grad_rel_l2"] = 0.05          # a gradient 5 % off
    res = train_check.compare(_runs(ref, ref, ref), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 5, init)
    assert not res["init_ok"] and not res["pass"]
    init["cuflash"].update(grad_rel_l2=3e-3, loss_diff=0.01)   # a forward 1e-2 nats off
    res = train_check.compare(_runs(ref, ref, ref), "cuflash", "sdpa_flash", "sdpa_efficient", 512, 5, init)
    assert not res["init_ok"]


def test_same_init_for_every_attention():
    mc, _ = train_check.SIZES["tiny"]
    a = train_check.build_model(mc, "cuflash", 7, "cpu")
    b = train_check.build_model(mc, "sdpa", 7, "cpu")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


@pytest.fixture
def one_thread():
    # a 2-core CI box with another busy process: 2 OpenMP threads are 100x slower than 1
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_train_check_tiny_cpu_sdpa(tmp_path, one_thread):
    """The whole pipeline (init check, training, comparison, JSON, plot) with SDPA only."""
    res = train_check.run_check(("sdpa", "sdpa_math", "sdpa"), "tiny", 2, "cpu", tmp_path,
                                log=lambda *_: None)
    assert res["comparison"]["pass"]
    data = json.loads((tmp_path / "cpu" / "train_check.json").read_text())
    assert set(data["runs"]) == {"sdpa", "sdpa_math"}
    assert len(data["runs"]["sdpa"]["loss"]) == 2
    if HAS_MPL:
        assert (tmp_path / "cpu" / "train_check.png").exists()


def test_train_check_tiny_cpu_cuflash(tmp_path, one_thread):
    """cuflash on CPU tensors runs through the NumPy reference (forward and backward)."""
    try:
        rc = train_check.main(["--device", "cpu", "--steps", "3", "--out", str(tmp_path)])
    except NotImplementedError as exc:
        pytest.skip(f"cuflash on torch CPU tensors / autograd not available yet: {exc}")
    data = json.loads((tmp_path / "cpu" / "train_check.json").read_text())
    assert set(data["runs"]) == {"cuflash", "sdpa"}
    assert data["comparison"]["finite"]
    assert rc == 0, data["comparison"]


@pytest.mark.skipif(_gpu.available(), reason="a GPU is usable: the check would run")
def test_cuda_without_gpu_is_one_error(tmp_path, capsys, monkeypatch):
    with pytest.raises(_gpu.NoGPUError):
        train_check.run_check(device="cuda", out=tmp_path, log=lambda *_: None)
    monkeypatch.setattr("sys.argv", ["train_check", "--out", str(tmp_path)])
    assert train_check._script() == 2
    err = capsys.readouterr().err
    assert err.startswith("cuflash.train_check: ") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())
