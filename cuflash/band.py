"""The band mask's block ranges on the host: a mirror of kernels_cu/mask.cuh ``BandMask``.

Which K/V blocks a Q block visits, which of those the kernel masks element by element, and
how much of the visited work is visible, for a (causal, window) problem and a tile shape
(BM query rows, BN keys). The kernels' block bounds are integer formulas of the problem
sizes; this module repeats them line for line, so that

* the window heuristic (families/sm90_fwd.py) and the features benchmark (the window's
  visible fraction) count blocks the way the kernels do, and
* the CPU tests can hold the formulas to a brute-force mask (tests/test_band_cpu.py).

Conventions as mask.cuh: bottom-right aligned, query i sees key j iff j < seqlen_k and
i + offset - left <= j <= i + offset + right (offset = seqlen_k - seqlen_q), a bound of -1
unbounded, causal forcing right = 0.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Band:
    """BandMask<kCausal, kWindow> of one problem (the constructor's arguments)."""

    seqlen_q: int
    seqlen_k: int
    causal: bool = False
    window: tuple = (-1, -1)     # (left, right); (-1, -1) is no window (kWindow false)

    @property
    def offset(self) -> int:
        return self.seqlen_k - self.seqlen_q

    @property
    def is_window(self) -> bool:
        return tuple(self.window) != (-1, -1)

    @property
    def left(self) -> int:
        return self.window[0] if self.is_window else -1

    @property
    def right(self) -> int:
        return 0 if self.causal else self.window[1] if self.is_window else -1

    @property
    def has_left(self) -> bool:
        return self.is_window and self.left >= 0

    @property
    def has_right(self) -> bool:
        return self.causal or (self.is_window and self.right >= 0)

    # -- block ranges (mask.cuh: kv_block_begin / kv_block_end, q_block_begin / q_block_end)

    def kv_block_end(self, row0: int, BM: int, BN: int) -> int:
        n = -(-self.seqlen_k // BN)
        if self.has_right:
            last_key = row0 + BM - 1 + self.offset + self.right
            n = 0 if last_key < 0 else min(n, last_key // BN + 1)
        return n

    def kv_block_begin(self, row0: int, BM: int, BN: int) -> int:
        return max(0, row0 + self.offset - self.left) // BN if self.has_left else 0

    def kv_blocks(self, row0: int, BM: int, BN: int) -> range:
        """The K/V blocks the queries [row0, row0 + BM) visit (empty when none)."""
        return range(self.kv_block_begin(row0, BM, BN), self.kv_block_end(row0, BM, BN))

    def q_block_begin(self, key0: int, BM: int) -> int:
        return max(0, (key0 - self.offset - self.right) // BM) if self.has_right else 0

    def q_block_end(self, key0: int, BM: int, BN: int, m_blocks: int) -> int:
        if not self.has_left:
            return m_blocks
        last_query = key0 + BN - 1 - self.offset + self.left
        return 0 if last_query < 0 else min(m_blocks, last_query // BM + 1)

    def needs_mask(self, row0: int, n_block: int, BN: int, rows: int) -> bool:
        """Whether the queries [row0, row0 + rows) and K/V block n_block hide any element
        (mask.cuh needs_mask<kBc, kBr> with kBr = rows)."""
        key0 = n_block * BN
        ragged = key0 + BN > self.seqlen_k
        right_edge = self.has_right and key0 + BN - 1 > row0 + self.offset + self.right
        left_edge = self.has_left and key0 < row0 + rows - 1 + self.offset - self.left
        return ragged or right_edge or left_edge

    # -- element level

    def visible_keys(self, query: int) -> int:
        """How many keys query ``query`` sees."""
        diag = query + self.offset
        hi = min(self.seqlen_k - 1, diag + self.right) if self.has_right else self.seqlen_k - 1
        lo = max(0, diag - self.left) if self.has_left else 0
        return max(0, hi - lo + 1)

    def visible(self) -> int:
        """Visible (query, key) pairs of the whole score matrix."""
        return sum(self.visible_keys(i) for i in range(self.seqlen_q))


def visible_fraction(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1),
                     relative_to_causal: bool = True) -> float:
    """The visible pairs of a window over those of the same call without it (the causal call
    when ``causal`` and ``relative_to_causal``, else the full s_q x s_k matrix)."""
    band = Band(seqlen_q, seqlen_k, causal, tuple(window))
    base = Band(seqlen_q, seqlen_k, causal and relative_to_causal).visible()
    return band.visible() / base if base else 0.0


@dataclasses.dataclass(frozen=True)
class BlockStats:
    """What a forward kernel of tile shape (BM, BN) does for one (batch, head) of a problem.

    q_blocks      Q blocks (tiles per head)
    kv_visits     Σ over Q blocks of the K/V blocks visited (loaded and computed)
    masked        Σ over Q blocks and mask groups of the visited blocks masked element by
                  element, in units of a whole Q block (a group of `rows` rows masking one
                  block counts rows / BM)
    computed      score elements computed: kv_visits · BM · BN
    visible       score elements visible
    max_visits    the longest Q block's loop (K/V blocks)
    """

    BM: int
    BN: int
    rows: int
    q_blocks: int
    kv_visits: int
    masked: float
    computed: int
    visible: int
    max_visits: int

    @property
    def overcompute(self) -> float:
        """computed / visible: 1.0 when every computed element is visible."""
        return self.computed / self.visible if self.visible else float("inf")

    @property
    def masked_share(self) -> float:
        """The share of visited blocks that run the element-wise mask."""
        return self.masked / self.kv_visits if self.kv_visits else 0.0

    @property
    def visits_per_q_block(self) -> float:
        return self.kv_visits / self.q_blocks if self.q_blocks else 0.0


def block_stats(band: Band, BM: int, BN: int, rows: int = 0) -> BlockStats:
    """Visits and masked blocks of a forward with Q blocks of BM rows and K/V blocks of BN
    keys; the mask is decided per group of ``rows`` rows (sm90_fwd: 64, one consumer
    warpgroup; fa2_fwd: BM, the CTA; 0 means BM)."""
    rows = rows or BM
    m_blocks = -(-band.seqlen_q // BM)
    visits = masked = longest = 0
    for m in range(m_blocks):
        row0 = m * BM
        blocks = band.kv_blocks(row0, BM, BN)
        visits += len(blocks)
        longest = max(longest, len(blocks))
        for n in blocks:
            masked += sum(band.needs_mask(r0, n, BN, rows) for r0 in range(row0, row0 + BM, rows))
    return BlockStats(BM, BN, rows, m_blocks, visits, masked * rows / BM, visits * BM * BN,
                      band.visible(), longest)


def aligned_bn(BM: int, candidates) -> list:
    """The candidates that divide BM (largest first): with such a BN and a window bound that is a
    multiple of it, the band's edges fall on block boundaries, so a Q block visits exactly
    (BM + left + right) / BN blocks and no block only for a sliver of the band."""
    return sorted((bn for bn in candidates if BM % bn == 0), reverse=True)


def every_q_block_has_keys(band: Band, BM: int, BN: int) -> bool:
    """Whether every Q block of BM rows visits at least one K/V block of BN keys (the forward's
    range, mask.cuh kv_block_begin / kv_block_end). sm90_fwd's tile_overlap issues a tile's first
    S = Q K_0ᵀ before the tile starts, so it runs only where this holds (a tile without keys has
    no S_0: families/sm90_fwd.py for_bounds)."""
    m_blocks = -(-band.seqlen_q // BM)
    return band.seqlen_k > 0 and all(len(band.kv_blocks(m * BM, BM, BN)) for m in range(m_blocks))


def every_q_block_visited(band: Band, BM: int, BN: int) -> bool:
    """Whether every Q block of BM rows lies in the backward's Q-block range of some K/V block of BN
    keys (mask.cuh q_block_begin / q_block_end under a window, CausalMask's q_block_begin otherwise).
    sm90_bwd's dq_first zeroes the dQ accumulator rows of the Q blocks some K/V block visits only
    (families/sm90_bwd.py dq_first_covers)."""
    m_blocks = -(-band.seqlen_q // BM)
    n_kv = -(-band.seqlen_k // BN)
    if m_blocks == 0:
        return True
    # the ranges' union, by a difference array (O(m_blocks + n_kv))
    diff = [0] * (m_blocks + 1)
    for n in range(n_kv):
        key0 = n * BN
        begin = band.q_block_begin(key0, BM)
        end = band.q_block_end(key0, BM, BN, m_blocks)
        if begin < end:
            diff[begin] += 1
            diff[end] -= 1
    depth = 0
    for m in range(m_blocks):
        depth += diff[m]
        if depth <= 0:
            return False
    return True
