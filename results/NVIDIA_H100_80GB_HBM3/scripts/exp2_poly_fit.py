"""Coefficients of the software exp2 in kernels_cu/exp2_emu.cuh (sm90_fwd's emu_exp2).

2^x = 2^j · 2^f with j = round(x) (round to nearest, what the 1.5·2^23 trick gives) and
f = x - j in [-1/2, 1/2]. 2^f is a polynomial p(f) = 1 + c1 f + ... + cn f^n: the constant is
exactly 1 so that p(0) = 1 (2^j exactly at integers, and the masked -inf, clamped to -127,
builds exactly 0). c1..cn minimise the largest *relative* error max |p(f) / 2^f - 1| on the
interval (a minimax fit, solved as a linear programme on a dense grid), then are rounded to
float32; the errors printed are of the float32 coefficients evaluated in float32 (Horner, FMA),
as the kernel does. Run: python exp2_poly_fit.py
"""
import numpy as np
from scipy.optimize import linprog


def minimax(degree: int, n: int = 4001) -> np.ndarray:
    f = np.linspace(-0.5, 0.5, n)
    y = np.exp2(f)
    # variables c1..cn, e; minimise e subject to |(1 + sum ck f^k) / y - 1| <= e
    a = np.stack([f ** k / y for k in range(1, degree + 1)], axis=1)
    b = 1.0 - 1.0 / y
    ones = np.ones((n, 1))
    a_ub = np.vstack([np.hstack([a, -ones]), np.hstack([-a, -ones])])
    b_ub = np.concatenate([b, -b])
    cost = np.zeros(degree + 1)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=[(None, None)] * (degree + 1), method="highs")
    assert res.success, res.message
    return np.concatenate([[1.0], res.x[:degree]])


def horner32(c: np.ndarray, f: np.ndarray) -> np.ndarray:
    c = c.astype(np.float32)
    f = f.astype(np.float32)
    p = np.full_like(f, c[-1])
    for ck in c[-2::-1]:
        p = (p.astype(np.float64) * f + ck).astype(np.float32)   # one FFMA: a single rounding
    return p


if __name__ == "__main__":
    f = np.linspace(-0.5, 0.5, 200001)
    for degree in (3, 4, 5):
        c = minimax(degree).astype(np.float32)
        err = np.abs(horner32(c, f).astype(np.float64) / np.exp2(f) - 1).max()
        print(f"degree {degree}: max rel err {err:.3e} ({np.log2(err):.1f} bits)  coefficients "
              + ", ".join(f"{float(x):.9g}f" for x in c))
