"""Dropout's mask on the GPU: philox.cuh's Dropout.apply (forward layout) and apply_transposed
(backward layout), on one warp's tile of ones, against the NumPy mirror cuflash.dropout, bit
for bit: the kernels and S_dmask then agree on which elements were dropped."""
import numpy as np
import pytest

from cuflash import dropout
from cuflash.compile import kernel_dir

pytestmark = pytest.mark.gpu

PROBE = r'''
#include "philox.cuh"
using namespace cuflash;
// One warp: a (kMT·16) x (kNT·8) tile of ones in the mma accumulator layout (rows g, g + 8 of
// each 16-row tile, columns 8·nt + 2t + e), dropout applied, written out row-major.
template <int kMT, int kNT, bool kT>
__global__ void probe(float* out, unsigned long long seed, unsigned long long offset, float p,
                      int bh, int row0, int col0) {
    const Dropout d = Dropout::make(seed, offset, p);
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    float acc[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 1.f;
    if (kT) d.apply_transposed(acc, bh, row0, col0, g, t);   // rows: keys, columns: queries
    else d.apply(acc, bh, row0, col0, g, t);                 // rows: queries, columns: keys
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                out[(16 * mt + g + 8 * (e / 2)) * (kNT * 8) + 8 * nt + 2 * t + e % 2] = acc[mt][nt][e];
}
'''
SHAPES = [(1, 16, False), (2, 8, False), (1, 22, False), (2, 8, True), (1, 4, True), (3, 6, True)]


@pytest.mark.parametrize("mt,nt,transposed", SHAPES, ids=lambda x: str(x))
def test_dropout_apply_matches_the_mirror(mt, nt, transposed):
    import cupy

    names = [f"probe<{m}, {n}, {'true' if tr else 'false'}>" for m, n, tr in SHAPES]
    mod = cupy.RawModule(code=PROBE, options=("-std=c++17", f"-I{kernel_dir()}"), name_expressions=names)
    kern = mod.get_function(f"probe<{mt}, {nt}, {'true' if transposed else 'false'}>")
    seed, offset, p, bh, row0, col0 = 0xDEADBEEF12345678, (5 << 32) + 96, 0.17, 7, 48, 32
    rows, cols = 16 * mt, 8 * nt
    out = cupy.full((rows, cols), np.nan, np.float32)
    kern((1,), (32,), (out, np.uint64(seed), np.uint64(offset), np.float32(p), np.int32(bh),
                       np.int32(row0), np.int32(col0)))
    got = out.get()
    if transposed:   # rows are keys from row0, columns queries from col0
        keep = dropout.keep_mask(seed, offset, p, 1, bh + 1, col0 + cols, row0 + rows)[0, bh]
        want = keep[col0:, row0:].T
    else:            # rows are queries from row0, columns keys from col0
        keep = dropout.keep_mask(seed, offset, p, 1, bh + 1, row0 + rows, col0 + cols)[0, bh]
        want = keep[row0:, col0:]
    scale = np.float32(1) / (np.float32(1) - np.float32(p))
    np.testing.assert_array_equal(got, np.where(want, scale, np.float32(0)))
