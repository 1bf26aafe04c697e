"""Block counts of windowed attention per tile shape (no GPU): the tables of
results/NVIDIA_H100_80GB_HBM3/features_window_analysis.md. cuflash.band mirrors mask.cuh.

    PYTHONPATH=. python results/NVIDIA_H100_80GB_HBM3/scripts/window_blocks.py [seqlen]
"""
import sys

from cuflash.band import Band, block_stats

S = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
CASES = {"causal (plain)": (True, (-1, -1)), "window (1024, 0) causal": (True, (1024, 0)),
         "full (plain)": (False, (-1, -1)), "window (1024, 1024)": (False, (1024, 1024))}
FWD = [("sm90_fwd", 128, 176, 64), ("sm90_fwd", 128, 160, 64), ("sm90_fwd", 128, 192, 64),
       ("sm90_fwd", 128, 144, 64), ("sm90_fwd", 128, 128, 64), ("sm90_fwd", 64, 64, 64),
       ("fa2_fwd", 128, 32, 128), ("fa2_fwd", 128, 64, 128)]


def bwd_stats(band, BM, BN):
    """fa2_bwd: per K/V block the Q blocks [q_block_begin, q_block_end), masked per pair."""
    m_blocks, n_blocks = -(-band.seqlen_q // BM), -(-band.seqlen_k // BN)
    visits = masked = longest = 0
    for n in range(n_blocks):
        lo, hi = band.q_block_begin(n * BN, BM), band.q_block_end(n * BN, BM, BN, m_blocks)
        visits += max(0, hi - lo)
        longest = max(longest, hi - lo)
        masked += sum(band.needs_mask(m * BM, n, BN, BM) for m in range(lo, hi))
    return visits / n_blocks, longest, masked / max(visits, 1), visits * BM * BN / band.visible()


print(f"seqlen {S}\n")
print("| mask | family | BM x BN (mask rows) | K/V blocks per Q block (mean / max) | masked share | computed / visible |")
print("|---|---|---|---|---|---|")
for name, (causal, window) in CASES.items():
    band = Band(S, S, causal, window)
    for fam, BM, BN, rows in FWD:
        st = block_stats(band, BM, BN, rows)
        print(f"| {name} | {fam} | {BM} x {BN} ({rows}) | {st.visits_per_q_block:.2f} / {st.max_visits} | "
              f"{st.masked_share:.3f} | {st.overcompute:.3f} |")
print("\n| mask | fa2_bwd Br x Bc | Q blocks per K/V block (mean / max) | masked share | computed / visible |")
print("|---|---|---|---|---|")
for name, (causal, window) in CASES.items():
    band = Band(S, S, causal, window)
    for BM, BN in ((64, 128), (32, 128)):
        mean, longest, share, over = bwd_stats(band, BM, BN)
        print(f"| {name} | {BM} x {BN} | {mean:.2f} / {longest} | {share:.3f} | {over:.3f} |")
