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

# The tuning spaces, as data: tunable parameter -> candidate values.
FWD_SPACE = {"Br": (64, 128), "Bc": (32, 64, 128), "warps": (4, 8), "stages": (2, 3)}
BWD_SPACE = {"Br": (32, 64, 128), "Bc": (64, 128), "warps": (4, 8), "stages": (2, 3),
             "dsplit": (1, 2), "qsplit": (1, 2)}

# The backward's fp32 workspace pads query rows to a multiple of this (every Br divides it).
BWD_ROW_PAD = 128


class ConfigError(ValueError):
    """A configuration the kernel cannot run; the message says which rule it breaks."""


def kernel_head_dim(head_dim: int) -> int:
    """Head dim the kernel is compiled for: the real one rounded up to a multiple of 16.

    Extra columns are zero-filled on load and never stored, so head dims 8, 24, 40, ...
    run on the next instantiation up.
    """
    return -(-head_dim // 16) * 16


class _KernelConfig:
    """What every kernel family's config shares: threads, the common rules, validate, replace.

    Subclasses are frozen dataclasses with at least Br, Bc, warps, stages, head_dim, dtype,
    causal, and define ``name``, ``smem_bytes``, ``accum_regs`` and ``_tile_problems()``.
    """

    _what = "kernel"          # in error messages: "invalid <what> config ..."
    _accum_names = ""         # the accumulators counted by accum_regs, for the message

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def problems(self, max_smem: Optional[int] = None) -> list[str]:
        """Every rule this config breaks (empty when valid)."""
        out = []
        if self.dtype not in DTYPES:
            out.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.head_dim % 16 or not 16 <= self.head_dim <= MAX_HEAD_DIM:
            out.append(f"head_dim must be a multiple of 16 in 16..{MAX_HEAD_DIM}, got {self.head_dim}")
        if not 1 <= self.warps <= 16:
            out.append(f"warps must be in 1..16, got {self.warps}")
        out += self._tile_problems()
        if self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        if not out and self.accum_regs > MAX_ACCUM_REGS:
            out.append(f"{self.accum_regs} fp32 accumulator registers per thread "
                       f"({self._accum_names}) exceed the budget of {MAX_ACCUM_REGS}: it would spill")
        if max_smem is not None and self.smem_bytes > max_smem:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, the device allows {max_smem}")
        return out

    def validate(self, max_smem: Optional[int] = None):
        problems = self.problems(max_smem)
        if problems:
            raise ConfigError(f"invalid {self._what} config {self.name}: " + "; ".join(problems))
        return self

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _first_fitting(config, shrinks, max_smem: int):
    """`config`, or the first of its shrunken variants that fits the device; else raise."""
    for shrink in ({},) + tuple(shrinks):
        candidate = config.replace(**shrink)
        if not candidate.problems(max_smem):
            return candidate
    return config.validate(max_smem)


def _space(cls, space: dict, head_dim: int, dtype: str, causal: bool, max_smem: Optional[int]):
    """Every point of `space` as a `cls` config, with the rules it breaks."""
    keys = list(space)
    for values in itertools.product(*(space[k] for k in keys)):
        cfg = cls(head_dim=head_dim, dtype=dtype, causal=causal, **dict(zip(keys, values)))
        yield cfg, cfg.problems(max_smem)


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig(_KernelConfig):
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
    _what, _accum_names = "forward", "O and S"

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"fwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"Br{self.Br}_Bc{self.Bc}_w{self.warps}_s{self.stages}")

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

    def kernel_names(self) -> dict:
        return {"main": self.kernel_name()}

    def template_args(self) -> tuple:
        return (self.Br, self.Bc, self.warps, self.stages, self.head_dim, self.dtype, self.causal)

    def _tile_problems(self) -> list[str]:
        out = []
        if 1 <= self.warps <= 16 and (self.Br <= 0 or self.Br % (16 * self.warps)):
            out.append(f"Br={self.Br} must be a positive multiple of 16*warps={16 * self.warps} "
                       "(each warp owns whole 16-row mma tiles)")
        if self.Bc % 16 or self.Bc <= 0:
            out.append(f"Bc must be a positive multiple of 16, got {self.Bc}")
        return out


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
    return _first_fitting(cfg, ({"Bc": 32}, {"Br": 64, "Bc": 32, "warps": 4}), max_smem)


def fwd_space(head_dim: int, dtype: str, causal: bool,
              max_smem: Optional[int] = None) -> Iterator[tuple[FwdConfig, list[str]]]:
    """Every point of FWD_SPACE for one problem class, with the rules it breaks (if any)."""
    return _space(FwdConfig, FWD_SPACE, kernel_head_dim(head_dim), dtype, causal, max_smem)


def valid_fwd_configs(head_dim: int, dtype: str, causal: bool,
                      max_smem: Optional[int] = None) -> list[FwdConfig]:
    return [cfg for cfg, problems in fwd_space(head_dim, dtype, causal, max_smem) if not problems]


# ---------------------------------------------------------------------------------------
# backward

@dataclasses.dataclass(frozen=True, order=True)
class BwdConfig(_KernelConfig):
    """One backward kernel (kernels_cu/flash_bwd.cu): a CTA owns the K/V block K_j, V_j.

    Br:            query rows of each Q block Q_i the CTA loops over (multiple of 16, <= 128)
    Bc:            keys of the CTA's K/V block; each key group (qsplit warps) owns
                   Bc * qsplit / warps of them
    warps:         warps per CTA
    stages:        Q/dO blocks resident in shared memory (>= 2)
    dsplit:        head-dim slices: `dsplit` CTAs share a K/V block, each accumulating
                   head_dim / dsplit columns of dK, dV, dQ (Sᵀ and dPᵀ are recomputed by each)
    head_dim:      the compile-time head dim (multiple of 16, <= 256)
    dtype:         "bf16" or "fp16"
    causal:        bottom-right aligned causal mask, a compile-time flag
    deterministic: dQ contributions added in a fixed order (bitwise reproducible, slower)
    qsplit:        warps per key group: 2 splits the group's Sᵀ, dPᵀ by queries and its dK, dV
                   by head-dim columns, with Pᵀ and dSᵀ shared through shared memory
    """

    Br: int
    Bc: int
    warps: int
    stages: int
    dsplit: int
    head_dim: int
    dtype: str
    causal: bool
    deterministic: bool = False
    qsplit: int = 1

    family = "flash_bwd"
    _what, _accum_names = "backward", "dK, dV, S, dP"

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        det = "_det" if self.deterministic else ""
        return (f"bwd_{self.dtype}_d{self.head_dim}_{mask}_"
                f"Br{self.Br}_Bc{self.Bc}_w{self.warps}_s{self.stages}_x{self.dsplit}_q{self.qsplit}{det}")

    @property
    def smem_bytes(self) -> int:
        """K_j, V_j; `stages` (Q_i, dO_i) pairs; the dSᵀ tile (and Pᵀ's when qsplit > 1);
        `stages` (LSE_i, D_i) rows."""
        pitch = self.head_dim + 8
        key_query_tiles = 1 if self.qsplit == 1 else 2
        elems = ((2 * self.Bc + 2 * self.stages * self.Br) * pitch
                 + key_query_tiles * self.Bc * (self.Br + 8))
        return 2 * elems + 8 * self.stages * self.Br

    @property
    def accum_regs(self) -> int:
        """fp32 accumulators per thread: dK, dV (keys x head_dim / dsplit / qsplit), Sᵀ/P, dPᵀ
        (keys x Br / qsplit)."""
        q = max(self.qsplit, 1)
        m_tiles = self.Bc * q // (16 * self.warps)
        return m_tiles * (self.head_dim // max(self.dsplit, 1) + self.Br) // q

    def kernel_name(self) -> str:
        b = lambda x: "true" if x else "false"  # noqa: E731
        return (f"cuflash::flash_bwd<{self.Br}, {self.Bc}, {self.warps}, {self.stages}, {self.dsplit}, "
                f"{self.qsplit}, {self.head_dim}, cuflash::{self.dtype}, {b(self.causal)}, "
                f"{b(self.deterministic)}>")

    def kernel_names(self) -> dict:
        """Every kernel one backward launches, by role (compiled into one module)."""
        return {"main": self.kernel_name(),
                "preprocess": f"cuflash::flash_bwd_preprocess<cuflash::{self.dtype}>",
                "convert_dq": f"cuflash::flash_bwd_convert_dq<cuflash::{self.dtype}>",
                "reduce_dkv": f"cuflash::flash_bwd_reduce_dkv<cuflash::{self.dtype}>"}

    def template_args(self) -> tuple:
        return (self.Br, self.Bc, self.warps, self.stages, self.dsplit, self.qsplit, self.head_dim,
                self.dtype, self.causal, self.deterministic)

    def _tile_problems(self) -> list[str]:
        out = []
        if self.qsplit not in (1, 2) or self.warps % self.qsplit:
            out.append(f"qsplit must be 1 or 2 and divide warps={self.warps}, got {self.qsplit}")
            return out
        groups = self.warps // self.qsplit
        if 1 <= self.warps <= 16 and (self.Bc <= 0 or self.Bc % (16 * groups)):
            out.append(f"Bc={self.Bc} must be a positive multiple of 16*warps/qsplit={16 * groups} "
                       "(each key group owns whole 16-key mma tiles)")
        if self.qsplit > 1 and (self.Br % (16 * self.qsplit)
                                or (self.head_dim // max(self.dsplit, 1)) % (16 * self.qsplit)):
            out.append(f"qsplit={self.qsplit} must split Br={self.Br} and the head-dim slice "
                       f"{self.head_dim // max(self.dsplit, 1)} into whole 16-wide tiles")
        if self.Br <= 0 or self.Br % 16 or BWD_ROW_PAD % self.Br:
            out.append(f"Br must be a multiple of 16 dividing {BWD_ROW_PAD}, got {self.Br}")
        elif self.Br // 2 > 32 * self.warps:
            out.append(f"Br={self.Br} needs {self.Br // 2} threads to load LSE_i and D_i, "
                       f"the CTA has {32 * self.warps}")
        if self.dsplit < 1 or (self.head_dim // 16) % self.dsplit:
            out.append(f"dsplit={self.dsplit} must divide head_dim/16={self.head_dim // 16} "
                       "(each slice is whole 16-column tiles)")
        return out


def bwd_kernel_head_dim(head_dim: int) -> int:
    """Head dim the backward is compiled for: up to 128 as the forward's (a multiple of 16),
    above 128 a multiple of 32, so that two head-dim slices (dsplit=2) are whole tiles."""
    return kernel_head_dim(head_dim) if head_dim <= 128 else -(-head_dim // 32) * 32


def default_bwd_config(head_dim: int, dtype: str, causal: bool,
                       arch: tuple[int, int] = (9, 0), max_smem: Optional[int] = None,
                       deterministic: bool = False) -> BwdConfig:
    """The backward's fallback heuristic (used when no tuned entry exists for this GPU).

    A warp owns 16·m keys (Bc = 16·m·warps): its rows of dK_j and dV_j cost m·head_dim fp32
    registers, Sᵀ and dPᵀ another m·Br. Large K/V blocks matter most: every Q block a CTA
    visits ends in Br x head_dim fp32 atomics into dQ, so Bc = 128 halves them against 64.
    Measured on the H100 (results/NVIDIA_H100_80GB_HBM3/bwd_sweep.json, s = 4096 and 16k):
    head dim 64 -> Br 32, Bc 128, 4 warps (m = 2); 128 -> Br 64, Bc 128, 8 warps as 4 key
    groups of 2 (qsplit = 2, m = 2: 3-4% faster than 8 warps of 16 keys, fewer ldmatrix per mma),
    both at the 192-register budget.
    Above 128, two CTAs share each K/V block, one per half of the head dim (dsplit = 2;
    Sᵀ and dPᵀ are computed twice), with Br = 32.
    """
    d = bwd_kernel_head_dim(head_dim)
    if max_smem is None:
        max_smem = MAX_SMEM_BY_ARCH.get(tuple(arch), 99 * 1024)
    if d <= 64:
        cfg = BwdConfig(32, 128, 4, 2, 1, d, dtype, causal, deterministic)
    elif d <= 128:
        cfg = BwdConfig(64, 128, 8, 2, 1, d, dtype, causal, deterministic, qsplit=2)
        if cfg.problems():  # head dims of an odd number of 16-column tiles (80, 112)
            cfg = cfg.replace(qsplit=1)
    else:
        cfg = BwdConfig(32, 64, 4, 2, 2, d, dtype, causal, deterministic)
    # Small-shared-memory parts: shrink the Q blocks, then the K/V block.
    return _first_fitting(cfg, ({"Br": 32}, {"Br": 32, "Bc": 64, "warps": 4},
                                {"Br": 16, "Bc": 64, "warps": 4}, {"Br": 16, "Bc": 32, "warps": 2}),
                          max_smem)


def bwd_space(head_dim: int, dtype: str, causal: bool,
              max_smem: Optional[int] = None) -> Iterator[tuple[BwdConfig, list[str]]]:
    """Every point of BWD_SPACE for one problem class, with the rules it breaks (if any)."""
    return _space(BwdConfig, BWD_SPACE, bwd_kernel_head_dim(head_dim), dtype, causal, max_smem)


def valid_bwd_configs(head_dim: int, dtype: str, causal: bool,
                      max_smem: Optional[int] = None) -> list[BwdConfig]:
    return [cfg for cfg, problems in bwd_space(head_dim, dtype, causal, max_smem) if not problems]
