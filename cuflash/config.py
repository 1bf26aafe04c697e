"""Kernel configurations: one frozen dataclass per kernel family.

A config is the single source of truth for one compiled kernel: the tuner's trial point,
the compile-cache key, the test id and a column in ``results/``. ``validate()`` repeats,
with readable reasons, the rules that the kernel's ``static_assert``s enforce in C++
(kernels_cu/flash_fwd.cu), plus the device's shared-memory limit.

Block-size knowledge lives here and only here: the search space (``FWD_SPACE``) and the
fallback heuristic (``default_fwd_config``). Tuned tables (tuning/) override the heuristic.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional

DTYPES = ("bf16", "fp16")
MAX_HEAD_DIM = 256

# Shared memory a CTA may opt into (bytes), by compute capability; the H100's is 227 KB.
# Used when no device is at hand (the CPU compile test, the tuner's replay mode).
MAX_SMEM_BY_ARCH = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                    (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                    (12, 0): 99 * 1024}

# Registers: mma accumulators a thread keeps live (O and S in fp32). Above this budget
# ptxas spills (read off `nvcc -Xptxas -v` for sm_80 / sm_90a; tests/test_compile.py).
MAX_ACCUM_REGS = 192

# The forward tuning space, as data: tunable parameter -> candidate values.
FWD_SPACE = {"Br": (64, 128), "Bc": (32, 64, 128), "warps": (4, 8), "stages": (2, 3)}


class ConfigError(ValueError):
    """A configuration the kernel cannot run; the message says which rule it breaks."""


def kernel_head_dim(head_dim: int) -> int:
    """Head dim the kernel is compiled for: the real one rounded up to a multiple of 16.

    Extra columns are zero-filled on load and never stored, so head dims 8, 24, 40, ...
    run on the next instantiation up.
    """
    return -(-head_dim // 16) * 16


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig:
    """One forward kernel: tiles (Br x Bc), warps, cp.async stages, and what it is built for.

    Br:        query rows per CTA (the Q block Q_i)
    Bc:        keys per K/V block (K_j, V_j)
    warps:     warps per CTA; each owns Br / warps whole rows of Q_i
    stages:    K/V blocks resident in shared memory (>= 2: compute one, load the next)
    head_dim:  the compile-time head dim (multiple of 16, <= 256)
    dtype:     "bf16" or "fp16"
    causal:    bottom-right aligned causal mask, a compile-time flag
    """

    Br: int
    Bc: int
    warps: int
    stages: int
    head_dim: int
    dtype: str
    causal: bool

    family = "flash_fwd"

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"fwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"Br{self.Br}_Bc{self.Bc}_w{self.warps}_s{self.stages}")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q_i plus `stages` (K_j, V_j) pairs, rows padded by 8."""
        pitch = self.head_dim + 8
        return (self.Br + 2 * self.stages * self.Bc) * pitch * 2

    @property
    def accum_regs(self) -> int:
        """fp32 accumulator registers per thread: O (rows x head_dim) and S (rows x Bc)."""
        m_tiles = self.Br // (16 * self.warps)
        return m_tiles * (self.head_dim + self.Bc) // 2

    def kernel_name(self) -> str:
        """The C++ name expression that instantiates this config's kernel."""
        return (f"cuflash::flash_fwd<{self.Br}, {self.Bc}, {self.warps}, {self.stages}, "
                f"{self.head_dim}, cuflash::{self.dtype}, {'true' if self.causal else 'false'}>")

    def problems(self, max_smem: Optional[int] = None) -> list[str]:
        """Every rule this config breaks (empty when valid)."""
        out = []
        if self.dtype not in DTYPES:
            out.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim % 16 or not 16 <= self.head_dim <= MAX_HEAD_DIM:
            out.append(f"head_dim must be a multiple of 16 in 16..{MAX_HEAD_DIM}, got {self.head_dim}")
        if not 1 <= self.warps <= 16:
            out.append(f"warps must be in 1..16, got {self.warps}")
        elif self.Br <= 0 or self.Br % (16 * self.warps):
            out.append(f"Br={self.Br} must be a positive multiple of 16*warps={16 * self.warps} "
                       "(each warp owns whole 16-row mma tiles)")
        if self.Bc % 16 or self.Bc <= 0:
            out.append(f"Bc must be a positive multiple of 16, got {self.Bc}")
        if self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        if not out and self.accum_regs > MAX_ACCUM_REGS:
            out.append(f"{self.accum_regs} fp32 accumulator registers per thread "
                       f"(O and S) exceed the budget of {MAX_ACCUM_REGS}: it would spill")
        if max_smem is not None and self.smem_bytes > max_smem:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, the device allows {max_smem}")
        return out

    def validate(self, max_smem: Optional[int] = None) -> "FwdConfig":
        problems = self.problems(max_smem)
        if problems:
            raise ConfigError(f"invalid forward config {self.name}: " + "; ".join(problems))
        return self

    def replace(self, **changes) -> "FwdConfig":
        return dataclasses.replace(self, **changes)


def default_fwd_config(head_dim: int, dtype: str, causal: bool,
                       arch: tuple[int, int] = (9, 0), max_smem: Optional[int] = None) -> FwdConfig:
    """The fallback heuristic, used when no tuned entry exists for this GPU.

    Each warp should own two 16-row tiles of Q (Br = 128 with 4 warps): every K or V
    fragment read from shared memory then feeds two mma instructions, which keeps
    shared-memory bandwidth under the tensor cores' appetite. That fits the register file
    up to head dim 128; above it the O accumulator alone is 128 registers per tile, so the
    CTA goes to 8 warps of one tile each. Bc trades S registers against loop overhead.

    The heuristic stays at <= 160 accumulator registers, where ptxas (nvcc 13.0, sm_80 and
    sm_90a) spills nothing; tests/test_compile.py holds it to that. Measured on the H100
    (results/NVIDIA_H100_80GB_HBM3/bench_fwd_sweep.json), the 192-register points
    (Br=128, 4 warps, Bc=128 at d=64 / Bc=64 at d=128) are 2-10% faster although ptxas
    spills a few bytes for them: choosing those is the tuner's job, by measurement.
    """
    d = kernel_head_dim(head_dim)
    if max_smem is None:
        max_smem = MAX_SMEM_BY_ARCH.get(tuple(arch), 99 * 1024)
    if d <= 64:
        cfg = FwdConfig(128, 64, 4, 2, d, dtype, causal)
    elif d <= 128:
        cfg = FwdConfig(128, 32, 4, 2, d, dtype, causal)
    else:
        cfg = FwdConfig(128, 64, 8, 2, d, dtype, causal)
    # Small-shared-memory parts (sm_86/89 have ~99 KB): shrink the K/V blocks, then Q.
    for shrink in ({}, {"Bc": 32}, {"Br": 64, "Bc": 32, "warps": 4}):
        candidate = cfg.replace(**shrink)
        if not candidate.problems(max_smem):
            return candidate
    return cfg.validate(max_smem)


def fwd_space(head_dim: int, dtype: str, causal: bool,
              max_smem: Optional[int] = None) -> Iterator[tuple[FwdConfig, list[str]]]:
    """Every point of FWD_SPACE for one problem class, with the rules it breaks (if any)."""
    d = kernel_head_dim(head_dim)
    keys = list(FWD_SPACE)
    for values in itertools.product(*(FWD_SPACE[k] for k in keys)):
        cfg = FwdConfig(head_dim=d, dtype=dtype, causal=causal, **dict(zip(keys, values)))
        yield cfg, cfg.problems(max_smem)


def valid_fwd_configs(head_dim: int, dtype: str, causal: bool,
                      max_smem: Optional[int] = None) -> list[FwdConfig]:
    return [cfg for cfg, problems in fwd_space(head_dim, dtype, causal, max_smem) if not problems]
