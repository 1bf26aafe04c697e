"""sm90_fwd_fp8: the FP8 (e4m3) FlashAttention forward for Hopper (kernels_cu/sm90_fwd_fp8.cu).

sm90_fwd's schedule (producer warpgroup + TMA ring, consumer warpgroups, FA3's intra-warpgroup
pipeline, pingpong, persistent tiles) with e4m3 Q, K, V, fp32 descale factors per (batch, kv
head) (flash-attn 3's ``q_descale``, ``k_descale``, ``v_descale``), bf16 output and fp32 LSE:

* S = Q Kᵀ by wgmma e4m3 (k32), fp32 accumulators; softmax_scale · q_descale · k_descale is the
  exp2 scale (and the LSE's scale), so the descales cost nothing per score.
* P is rounded to e4m3 for O += P V (wgmma e4m3 with A from registers) as 256 · P (FA3's
  exp2 offset of 8: small weights keep e4m3 precision instead of flushing to zero); v_descale /
  256 multiplies O in the epilogue with 1 / l.
* FP8 wgmma reads shared-memory operands K-major only, so the kernel reads Vᵀ. A second kernel
  of the family (role "prepare", launched before "main") writes Vᵀ into the launch's
  workspace: (batch, nheads_kv, head_dim, seqlen_k rounded up to 16), keys contiguous and,
  inside each group of 16 keys, in the order ``PERM16``: position 4t + i holds key {2t, 2t+1,
  8+2t, 9+2t}[i]. With that order the S accumulators a thread holds are, in order, its e4m3 A
  fragment for P V (FA3 shuffles P's bytes between threads instead), so P goes to registers
  with cvts only. Choice: one memory-bound tile transpose of V per call (one read and one
  write of V's bytes, coalesced both ways; small next to the seqlen_q x seqlen_k work at long
  sequences) in place of FA3's in-kernel producer transpose (ldmatrix.trans / stmatrix); the
  two launches show separately in a profile (nsys / ncu). ``cuflash.fp8.vt_mirror`` is the
  NumPy statement of the layout the tests hold the kernel to.

Workspace (``workspace()``): the three descales expanded to (batch, nheads_kv) fp32, then Vᵀ,
256-byte aligned; the prepare kernel fills it from V and the caller's descales (per-call
fields ``q_descale_in`` ..., ``descale_per_head``: ``cuflash.fp8.run_plan``).

Selection: this family alone claims dtype "e4m3" (``dtypes``); the bf16/fp16 families leave
it alone (``cuflash.select`` asks ``Family.dtypes`` first). Not implemented: fp16 output,
head dims 192 and > 256, BN other than 128, FA3's in-kernel V transpose, features (window,
softcap, ...), varlen.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np

from ..problem import Problem
from ..registry import register
from .base import Family, KernelConfig, LaunchSpec, default_max_smem
from .fa2_fwd import first_fitting, forward_sizes, strides3
from . import sm90_fwd as _sm90
from .sm90_fwd import L2_PROMOTION_128B, OOB_FILL_ZEROS, SWIZZLE_128B

HEAD_DIMS = (64, 128, 256)
MAX_SMEM = 227 * 1024
BN = 128                         # keys per block: one 128-byte swizzled row of Vᵀ
BOX_BYTES = 128                  # TMA box inner extent: the 128B swizzle span (128 e4m3)
CU_TENSOR_MAP_DATA_TYPE_U8 = 0   # TMA moves bytes; e4m3 needs no type of its own
# Key order inside each group of 16 keys of Vᵀ (module docstring): PERM16[4t + i] is the key
# whose P value thread t holds as byte i of its A fragment register.
PERM16 = tuple(k for t in range(4) for k in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t))
# (consumers, head_dim) that ptxas (nvcc 13.0, sm_90a) builds without spills: with 3 consumer
# warpgroups (160 registers) only head dim 64 fits (O 32 + S 64 accumulators).
NO_SPILL = {1: HEAD_DIMS, 2: HEAD_DIMS, 3: (64,)}
# The prepare kernel's tile (kernels_cu/sm90_fwd_fp8.cu sm90_fwd_fp8_prepare): keys x head-dim
# columns per CTA of 128 threads.
PREP_KEYS, PREP_COLS, PREP_THREADS = 128, 64, 128


@dataclasses.dataclass(frozen=True, order=True)
class Sm90FwdFp8Config(KernelConfig):
    """One sm90_fwd_fp8 kernel (fields as Sm90FwdConfig; dtype is the inputs' "e4m3", the
    output is bf16).

    BM:        64 · consumers query rows
    BN:        keys per block: 128
    stages, consumers, pingpong, persistent: as sm90_fwd
    head_dim:  64, 128 or 256
    """

    BM: int
    BN: int
    stages: int
    consumers: int
    pingpong: bool
    persistent: bool
    head_dim: int
    dtype: str
    causal: bool

    family = "sm90_fwd_fp8"
    dtypes: ClassVar[tuple] = ("e4m3",)
    _what = "sm90 fp8 forward"

    @property
    def warps(self) -> int:
        return 4 * (self.consumers + 1)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"sm90fwdfp8_{self.dtype}_d{self.head_dim}_{mask}_"
                f"BM{self.BM}_BN{self.BN}_s{self.stages}_c{self.consumers}{'_pp' if self.pingpong else ''}"
                f"{'_persist' if self.persistent else ''}")

    @property
    def chunks(self) -> int:
        return -(-self.head_dim // BOX_BYTES)

    @property
    def smem_bytes(self) -> int:
        """As the kernel's Sm90FwdFp8Shape::kSmemBytes: Q and K in 128-byte rows (head dim 64
        half used), Vᵀ tiles of head_dim x BN bytes, the mbarriers, 1024 bytes of alignment."""
        return ((self.BM + self.stages * self.BN) * self.chunks * BOX_BYTES
                + self.stages * self.head_dim * self.BN + 8 * (2 + 4 * self.stages) + 1024)

    def kernel_name(self) -> str:
        return (f"cuflash::sm90_fwd_fp8<{self.BM}, {self.BN}, {self.stages}, {self.consumers}, "
                f"{'true' if self.pingpong else 'false'}, {'true' if self.persistent else 'false'}, "
                f"{self.head_dim}, cuflash::bf16, {'true' if self.causal else 'false'}>")

    def template_args(self) -> tuple:
        return (self.BM, self.BN, self.stages, self.consumers, self.pingpong, self.persistent,
                self.head_dim, "bf16", self.causal)

    def _problems(self) -> list[str]:
        out = []
        if self.head_dim not in HEAD_DIMS:
            out.append(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.consumers not in (1, 2, 3):
            out.append(f"consumers must be 1, 2 or 3, got {self.consumers}")
        elif self.BM != 64 * self.consumers:
            out.append(f"BM={self.BM} must be 64 * consumers = {64 * self.consumers}")
        if self.BN != BN:
            out.append(f"BN must be {BN} (one 128-byte row of V transposed), got {self.BN}")
        if self.pingpong and self.consumers == 1:
            out.append(f"pingpong needs 2 or 3 consumer warpgroups, got {self.consumers}")
        if self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        if not out and self.head_dim not in NO_SPILL[self.consumers]:
            out.append(f"head_dim {self.head_dim} with {self.consumers} consumer warpgroups would "
                       f"spill (budget: head dims {NO_SPILL[self.consumers]})")
        if not out and self.smem_bytes > MAX_SMEM:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, more than the "
                       f"{MAX_SMEM} an sm_90 CTA can have")
        return out


def vt_shape(problem: Problem) -> tuple:
    """(batch, nheads_kv, head_dim, seqlen_k rounded up to 16): the Vᵀ copy the kernel reads."""
    p = problem
    return (p.batch, p.nheads_kv, p.head_dim, -(-p.seqlen_k // 16) * 16)


def tensor_map_args_fp8(ptr: int, shape, strides, rows: int) -> tuple:
    """cuTensorMapEncodeTiled arguments of e4m3 q or k (batch, seqlen, heads, head_dim; strides
    in elements = bytes): box 128 bytes x rows, 128B swizzle, zero fill (head dim 64: the box's
    upper half)."""
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    strides_bytes = tuple(s if n > 1 else 16 for s, n in
                          ((strides[1], seqlen), (strides[2], heads), (strides[0], batch)))
    return (CU_TENSOR_MAP_DATA_TYPE_U8, ptr, dims, strides_bytes, (BOX_BYTES, rows, 1, 1),
            SWIZZLE_128B, L2_PROMOTION_128B, OOB_FILL_ZEROS)


def tensor_map_args_vt(ptr: int, shape, head_dim_box: int) -> tuple:
    """The map of Vᵀ (vt_shape, contiguous): rank 4 innermost first (keys, head dim, kv head,
    batch), box BN keys x head_dim_box rows (rows past the real head dim zero-filled)."""
    batch, heads, head_dim, keys = shape
    dims = (keys, head_dim, heads, batch)
    strides_bytes = (keys, keys * head_dim if heads > 1 else 16,
                     keys * head_dim * heads if batch > 1 else 16)
    return (CU_TENSOR_MAP_DATA_TYPE_U8, ptr, dims, strides_bytes, (BN, head_dim_box, 1, 1),
            SWIZZLE_128B, L2_PROMOTION_128B, OOB_FILL_ZEROS)


class Sm90ForwardFp8(Family):
    name = "sm90_fwd_fp8"
    op = "fwd"
    version = 1
    config_cls = Sm90FwdFp8Config
    dtypes = ("e4m3",)
    space = {"BM": (64, 128, 192), "BN": (128,), "stages": (2, 3), "consumers": (1, 2, 3),
             "pingpong": (False, True), "persistent": (False, True)}
    params_struct = "Sm90FwdFp8Params"
    kernel_param_decl = "const __grid_constant__ cuflash::Sm90FwdFp8Params"
    pointer_fields = ("q", "k", "v", "o", "lse", "q_descale", "k_descale", "v_descale", "vt")
    min_arch = (9, 0)
    arch_suffix = "a"
    priority = 1
    description = "Hopper FP8 (e4m3) forward: sm90_fwd's schedule, wgmma e4m3, V transposed"

    def supports(self, arch, problem: Problem) -> str:
        if problem.op != self.op:
            return f"{self.name} implements op {self.op!r}, not {problem.op!r}"
        if problem.features:
            return f"{self.name} has no feature {problem.features[0]!r}"
        if problem.dtype not in self.dtypes:
            return f"{self.name} runs dtype e4m3 only, got {problem.dtype}"
        if problem.head_dim % 16 or not 0 < problem.head_dim <= HEAD_DIMS[-1]:
            return f"q: headdim must be a multiple of 16 in 16..{HEAD_DIMS[-1]} for fp8, got {problem.head_dim}"
        if tuple(arch)[0] != 9:
            return f"{self.name} needs sm_90 exactly (sm_90a: wgmma e4m3, TMA), got sm_{arch[0]}{arch[1]}"
        return ""

    def head_dim_of(self, head_dim: int) -> int:
        return next((d for d in HEAD_DIMS if d >= head_dim), HEAD_DIMS[-1])

    def heuristic(self, problem: Problem, arch=(9, 0), max_smem: Optional[int] = None) -> Sm90FwdFp8Config:
        """Two consumer warpgroups with pingpong, BM 128, BN 128, two stages (FA3's fp8 d256
        tile is 128 x 128; its d64 192 x 160 and d128 128 x 224 are not expressible here:
        BN is 128). Not yet measured."""
        d = self.head_dim_of(problem.head_dim)
        max_smem = default_max_smem(arch) if max_smem is None else max_smem
        cfg = Sm90FwdFp8Config(128, BN, 2, 2, True, False, d, "e4m3", bool(problem.causal))
        return first_fitting(cfg, ({"BM": 64, "consumers": 1, "pingpong": False},), max_smem)

    def kernel_names(self, config) -> dict:
        return {"prepare": f"cuflash::sm90_fwd_fp8_prepare<{PREP_KEYS}, {PREP_COLS}>",
                "main": config.kernel_name()}

    def launches(self, config, problem: Problem, sm_count: int) -> list:
        p = problem
        tiles = -(-p.seqlen_q // config.BM) * p.nheads * p.batch
        if tiles >= 2 ** 31:
            raise ValueError(f"batch * nheads * seqlen_q: too many Q blocks for one launch ({tiles})")
        prep = (p.batch * p.nheads_kv * -(-p.head_dim // PREP_COLS)
                * -(-vt_shape(p)[3] // PREP_KEYS))
        if prep >= 2 ** 31:
            raise ValueError(f"batch * nheads_kv * seqlen_k: too many Vᵀ tiles for one launch ({prep})")
        grid = (min(tiles, sm_count) if config.persistent else tiles, 1, 1)
        # prepare first: main reads the Vᵀ and descales it writes (stream order)
        return [LaunchSpec("prepare", (prep, 1, 1), PREP_THREADS, 0),
                LaunchSpec("main", grid, config.threads, config.smem_bytes)]

    def workspace(self, config, problem: Problem, strides: Optional[dict] = None) -> dict:
        """The descales ((batch, nheads_kv) fp32 each) and Vᵀ, each 256-byte aligned."""
        n = problem.batch * problem.nheads_kv * 4
        step = -(-n // 256) * 256
        vt = 3 * step
        return {"q_descale": 0, "k_descale": step, "v_descale": 2 * step, "vt": vt,
                "total": vt + int(np.prod(vt_shape(problem)))}

    def static_params(self, config, problem, strides, workspace, softmax_scale, sm_count) -> dict:
        sv = tuple(strides["v"])
        return dict(tma_q=0, tma_k=0, tma_v=0, **strides3("o", strides["o"]),
                    **forward_sizes(problem, softmax_scale),
                    v_batch_stride=sv[0], v_row_stride=sv[1], v_head_stride=sv[2], v_col_stride=sv[3],
                    q_descale_in=0, k_descale_in=0, v_descale_in=0, vt_keys=vt_shape(problem)[3],
                    descale_per_head=0)

    def call_writer(self, config, problem: Problem, strides: dict, struct):
        """The tensor maps of q (ptrs[0]), k (ptrs[1]) and Vᵀ (ptrs[8], in the workspace) into
        the packed params, cached per address triple (sm90_fwd's scheme)."""
        p = problem
        offs = [struct.fields[f"tma_{t}"][1] for t in ("q", "k", "v")]
        if offs != list(range(offs[0], offs[0] + 3 * 128, 128)):
            raise RuntimeError(f"{self.params_struct}: tma_q, tma_k, tma_v must be adjacent")
        start, end = offs[0], offs[0] + 3 * 128
        q_shape = (p.batch, p.seqlen_q, p.nheads, p.head_dim)
        k_shape = (p.batch, p.seqlen_k, p.nheads_kv, p.head_dim)
        vts = vt_shape(p)
        sq, sk = tuple(strides["q"]), tuple(strides["k"])
        blobs: dict = {}

        def write(buf, ptrs):
            key = (ptrs[0], ptrs[1], ptrs[8])
            blob = blobs.get(key)
            if blob is None:
                if len(blobs) >= 64:
                    blobs.clear()
                enc = _sm90._encoder   # looked up per encode: tests swap in a fake
                blob = blobs[key] = np.frombuffer(
                    enc(*tensor_map_args_fp8(ptrs[0], q_shape, sq, config.BM))
                    + enc(*tensor_map_args_fp8(ptrs[1], k_shape, sk, config.BN))
                    + enc(*tensor_map_args_vt(ptrs[8], vts, config.head_dim)), np.uint8)
            buf[start:end] = blob

        return write


FAMILY = register(Sm90ForwardFp8())
