"""cuflash.bench.decode without a GPU: the paged views read the contiguous cache's bytes (issue 13:
paged within 10% of contiguous, timed on one memory in shuffled interleaved rounds)."""
import pytest

torch = pytest.importorskip("torch")

from cuflash.bench import decode as bench  # noqa: E402


def test_paged_view_covers_each_rows_keys_once():
    batch, ctx, page = 3, 64, 16
    kc = torch.arange(batch * ctx * 2 * 4, dtype=torch.float32).view(batch, ctx, 2, 4)
    vc = kc + 0.5
    kp, vp, table = bench.paged_view(kc, vc, page, torch.Generator().manual_seed(1))
    assert kp.shape == (batch * ctx // page, page, 2, 4) and table.dtype == torch.int32
    assert kp.data_ptr() == kc.data_ptr() and vp.data_ptr() == vc.data_ptr()   # views, no copy
    for b in range(batch):
        got = kp[table[b].long()].reshape(ctx, 2, 4)
        # the same keys as row b of the contiguous cache, in another order of pages
        assert sorted(got[:, 0, 0].tolist()) == sorted(kc[b, :, 0, 0].tolist())
        assert set(table[b].tolist()) == set(range(b * ctx // page, (b + 1) * ctx // page))
    with pytest.raises(ValueError, match="page"):
        bench.paged_view(kc, vc, 48)
