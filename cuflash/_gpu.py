"""Is there a GPU, and what is it. Every question is answered without raising."""
from __future__ import annotations

import functools


class NoGPUError(RuntimeError):
    """Raised when a GPU kernel is asked for on a machine without a usable CUDA GPU."""


@functools.lru_cache(maxsize=1)
def why_unavailable() -> str:
    """'' when a CUDA GPU is usable through CuPy, else the reason."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU path
        return f"CuPy is not importable ({exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device is visible"
    except Exception as exc:  # noqa: BLE001
        return f"the CUDA driver is not usable ({exc.__class__.__name__}: {exc})"
    return ""


def available() -> bool:
    return why_unavailable() == ""


def require(what: str) -> None:
    reason = why_unavailable()
    if reason:
        raise NoGPUError(
            f"{what} needs a CUDA GPU, but {reason}. For a CPU result use "
            "cuflash.reference.attention_naive(q, k, v, causal=...) (float64) or "
            "cuflash.reference.attention_tiled (the same algorithm, tiled).")


@functools.lru_cache(maxsize=None)
def arch(device: int = 0) -> tuple[int, int]:
    import cupy

    cc = cupy.cuda.Device(device).compute_capability  # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


@functools.lru_cache(maxsize=None)
def max_smem(device: int = 0) -> int:
    """Dynamic shared memory one block may opt into, in bytes."""
    import cupy

    return int(cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


@functools.lru_cache(maxsize=None)
def sm_count(device: int = 0) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def name(device: int = 0) -> str:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["name"].decode()
