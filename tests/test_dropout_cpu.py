"""Dropout's random numbers: kernels_cu/philox.cuh and its NumPy mirror cuflash/dropout.py.

The mirror computes the keep mask the kernels draw, bit for bit (the GPU tests compare a
kernel's S_dmask with it); here the two are held to Random123's known-answer vectors and to
each other (philox.cuh compiled for the host by nvcc)."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from cuflash import dropout
from cuflash.compile import kernel_dir

NVCC = os.environ.get("NVCC", "nvcc")

# Random123's known answers for Philox4x32-10: (counter, key) -> output
KAT = [((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("args,want", KAT)
def test_numpy_philox_known_answers(args, want):
    assert tuple(int(x) for x in dropout.philox4x32_10(*args)) == want


def test_keep_mask_shape_rate_and_determinism():
    m = dropout.keep_mask(1234, 77, 0.17, 2, 3, 65, 200)
    assert m.shape == (2, 3, 65, 200) and m.dtype == bool
    assert abs(m.mean() - (1 - dropout.drop_threshold(0.17) / 256)) < 0.01
    assert np.array_equal(m, dropout.keep_mask(1234, 77, 0.17, 2, 3, 65, 200))
    assert not np.array_equal(m, dropout.keep_mask(1234, 78, 0.17, 2, 3, 65, 200))   # offset
    assert not np.array_equal(m, dropout.keep_mask(1235, 77, 0.17, 2, 3, 65, 200))   # seed
    # a column's bits do not depend on seqlen_k (the counter is per 16-column block)
    assert np.array_equal(m[..., :100], dropout.keep_mask(1234, 77, 0.17, 2, 3, 65, 100))
    assert dropout.keep_mask(1, 2, 0.0, 1, 1, 4, 40).all()


@pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
def test_philox_cuh_matches_the_numpy_mirror(tmp_path):
    """philox.cuh, compiled for the host, gives the mirror's known answers and keep mask (the
    canonical byte -> column order included) for a seed and offset with high bits set."""
    seed, offset, p, bh, sq, sk = 0x1234_5678_9ABC_DEF0, 0x0000_0003_0000_0010, 0.17, 6, 33, 70
    src = tmp_path / "t.cu"
    src.write_text(f'''#include "philox.cuh"
#include <cstdio>
using namespace cuflash;
int main() {{
    auto r = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
    printf("%08x %08x %08x %08x\\n", r.w[0], r.w[1], r.w[2], r.w[3]);
    const Dropout d = Dropout::make({seed}ull, {offset}ull, {p}f);
    for (int h = 0; h < {bh}; ++h)
        for (int i = 0; i < {sq}; ++i) {{
            for (int j = 0; j < {sk}; ++j) {{
                const PhiloxWords w = d.bytes(h, i, j / 16);
                const int c = j % 16, word = (c % 8) / 2, b = (c & 1) + 2 * (c / 8);
                putchar(d.factor(w.w[word], b) != 0.f ? '1' : '0');
            }}
            putchar('\\n');
        }}
}}
''')
    exe = tmp_path / "t"
    subprocess.run([NVCC, "-I", str(kernel_dir()), "-o", str(exe), str(src)], check=True,
                   capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert lines[:4] == ["d16cfe09", "94fdcceb", "5001e420", "24126ea1"]
    got = np.array([[c == "1" for c in line] for line in lines[4:]]).reshape(1, bh, sq, sk)
    assert np.array_equal(got, dropout.keep_mask(seed, offset, p, 1, bh, sq, sk))


@pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dropout_apply_compiles_to_registers(tmp_path, arch):
    """Dropout.apply / apply_transposed on accumulator tiles of the shapes the kernels use
    (sm90_fwd's 1 x 22: an odd number of 16-column blocks) keep everything in registers: no
    stack frame, no spills (a run-time index into a register array would put it in memory)."""
    src = tmp_path / "k.cu"
    src.write_text('''#include "philox.cuh"
using namespace cuflash;
template <int kMT, int kNT, bool kT>
__global__ void k(float* out, Dropout d) {
    float acc[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)\n#pragma unroll\n for (int nt = 0; nt < kNT; ++nt)\n#pragma unroll\n for (int e = 0; e < 4; ++e)\n   
        acc[mt][nt][e] = out[threadIdx.x + 32 * (e + 4 * (nt + kNT * mt))];
    if (kT)
        d.apply_transposed(acc, blockIdx.y, 64 * blockIdx.x, 16 * blockIdx.z, threadIdx.x % 32 / 4, threadIdx.x % 4);
    else
        d.apply(acc, blockIdx.y, 64 * blockIdx.x, 16 * blockIdx.z, threadIdx.x % 32 / 4, threadIdx.x % 4);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)\n#pragma unroll\n for (int nt = 0; nt < kNT; ++nt)\n#pragma unroll\n for (int e = 0; e < 4; ++e)\n   
        out[threadIdx.x + 32 * (e + 4 * (nt + kNT * mt))] = acc[mt][nt][e];
}
template __global__ void k<1, 16, false>(float*, Dropout);   // fa2_fwd Br 128, 8 warps, Bc 128
template __global__ void k<2, 8, false>(float*, Dropout);    // fa2_fwd Br 128, 4 warps, Bc 64
template __global__ void k<1, 22, false>(float*, Dropout);   // sm90_fwd BN 176
template __global__ void k<2, 8, true>(float*, Dropout);     // fa2_bwd: 32 keys x 64 queries a warp
template __global__ void k<1, 4, true>(float*, Dropout);     // fa2_bwd: 16 keys x 32 queries
''')
    res = subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-I", str(kernel_dir()),
                          "-o", str(tmp_path / "k.cubin"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    frames = [line for line in res.stderr.splitlines() if "stack frame" in line]
    assert len(frames) == 5 and all("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
                                    in line for line in frames), res.stderr
