"""ParallelMHA on GPUs over NCCL: tests/parallel_mha_gpu_check.py's checks (every case, the
float64 single-process reference, 2x / 3x the plain low-precision error) as pytest tests. The
2-rank test needs two GPUs and skips with the reason below that; the 1-rank test runs the same
checks on one GPU (the parallel linears over a one-rank NCCL group).

    timeout 600 python -m pytest -q -s tests/test_parallel_mha_gpu.py
"""
import pytest

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def _run(world):
    import parallel_mha_gpu_check as check

    summary = check.run(world=world)
    lines = [f"{r['case']} rank {r['rank']} {r['what']}: err {r['err']:.3g} > {r['factor']} x plain "
             f"{r['plain_err']:.3g}" for r in summary["failures"]]
    assert summary["ok"], "\n".join(lines + summary["errors"])
    assert summary["checks"] > 0


def test_parallel_mha_one_rank():
    _run(1)


@pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 GPUs for a 2-rank NCCL group, this machine has {_gpus()}")
def test_parallel_mha_two_ranks():
    _run(2)
