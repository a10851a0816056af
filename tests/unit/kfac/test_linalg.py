import pytest
import torch

from spdkfac.kfac.linalg import all_finite, invert_spd, pack_upper, triangle_size, unpack_upper


@pytest.mark.parametrize("d", [1, 2, 5, 17, 2048, 2050])  # both the gather and the row-wise paths
def test_pack_unpack_roundtrip(d):
    m = torch.randn(d, d, dtype=torch.float64)
    sym = m + m.T
    packed = pack_upper(sym)
    assert packed.numel() == triangle_size(d) == d * (d + 1) // 2
    assert torch.equal(unpack_upper(packed, d), sym)
    stale = torch.full((d, d), float("nan"), dtype=torch.float64)  # a reused buffer: nothing of it may survive
    assert torch.equal(unpack_upper(packed, d, out=stale), sym)


def test_pack_into_buffer_slice():
    sym = torch.arange(9.0).reshape(3, 3)
    sym = sym + sym.T
    buf = torch.zeros(10)
    pack_upper(sym, out=buf[2:8])
    assert torch.equal(buf[2:8], torch.tensor([0.0, 4, 8, 8, 12, 16]))
    assert buf[:2].abs().sum() == 0
    assert buf[8:].abs().sum() == 0


def test_unpack_rejects_wrong_size():
    with pytest.raises(ValueError, match="expected 6"):
        unpack_upper(torch.zeros(5), 3)


def test_invert_spd_matches_dense_inverse():
    torch.manual_seed(0)
    a = torch.randn(12, 6, dtype=torch.float64)
    f = a.T @ a / 12
    inv = invert_spd(f, 0.1)
    expected = torch.linalg.inv(f + 0.1 * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(inv, expected)
    assert torch.equal(inv, inv.T)


def test_invert_spd_rank_deficient_needs_damping():
    f = torch.zeros(4, 4, dtype=torch.float64)
    torch.testing.assert_close(invert_spd(f, 2.0), torch.eye(4, dtype=torch.float64) / 2)


def test_all_finite():
    assert all_finite(torch.ones(3, 3))
    assert all_finite(torch.full((4,), 3e38))  # the sum overflows, the elements are fine
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(5)
        t[2] = bad
        assert not all_finite(t)


def test_pack_row_path_matches_gather_path():
    from spdkfac.kfac import linalg

    m = torch.randn(2100, 2100)
    m = m + m.T
    rows = pack_upper(m)
    idx = linalg._flat_upper_indices(2100, m.device)
    assert torch.equal(rows, m.reshape(-1)[idx])


@pytest.mark.parametrize("d", [3, 255, 256, 300, 769, 1030])  # unblocked, 128-wide and 256-wide strips, ragged edges
def test_symmetric_gram_equals_full_product_and_is_exactly_symmetric(d):
    from spdkfac.kfac.linalg import symmetric_gram

    torch.manual_seed(d)
    rows = torch.randn(40, d, dtype=torch.float64)
    gram = symmetric_gram(rows)
    torch.testing.assert_close(gram, rows.T @ rows)
    assert torch.equal(gram, gram.T)


@pytest.mark.parametrize(
    ("c", "size", "layout"),
    [
        (c, size, layout)
        for c, size in [(5, (12, 11)), (300, (12, 12)), (5, (3, 4)), (300, (2, 3)), (7, (130,))]
        for layout in ("nchw", "channels_last", "strided")
        if layout != "channels_last" or len(size) == 2
    ],
)
def test_channel_gram_equals_gram_of_the_channel_rows(c, size, layout):
    """Per-sample in place (>= 128 positions), channel-major copy (fewer), and channels-last rows: one Gram."""
    from spdkfac.kfac.linalg import channel_gram

    torch.manual_seed(c)
    x = torch.randn(3, c, *size, dtype=torch.float64)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.randn(3, c, *(2 * s for s in size), dtype=torch.float64)[(slice(None), slice(None)) + (slice(None, None, 2),) * len(size)]
    rows = x.movedim(1, -1).reshape(-1, c)
    gram = channel_gram(x)
    torch.testing.assert_close(gram, rows.T @ rows, rtol=1e-12, atol=1e-12)
    assert torch.equal(gram, gram.T)


def test_mirror_upper_keeps_upper_and_replaces_lower():
    from spdkfac.kfac.linalg import mirror_upper_

    m = torch.randn(11, 11)
    upper = torch.triu(m)
    out = mirror_upper_(m.clone(), block=4)  # strips of 4: diagonal blocks, off-diagonal strips, a ragged last one
    assert torch.equal(torch.triu(out), upper)
    assert torch.equal(out, out.T)


@pytest.mark.parametrize("by", ["sum", "norm"], ids=["cpu-sums", "gpu-norms"])
def test_non_finite_indices(by, monkeypatch):
    """NaN, +inf and -inf anywhere are found; huge finite values (whose sum overflows) are not; dtypes mix. By the
    CPU's sums and by the largest magnitudes a GPU reads (forced here)."""
    from spdkfac.kfac import linalg
    from spdkfac.kfac.linalg import non_finite_indices

    monkeypatch.setattr(linalg, "checks_by_norm", lambda device: by == "norm")

    big = torch.full((4,), 3e38)  # finite, but its sum is inf in float32
    tensors = [torch.ones(3), big, torch.ones(2, 2, dtype=torch.float64), torch.zeros(5), torch.ones(1, dtype=torch.bfloat16)]
    assert non_finite_indices(tensors) == []
    assert non_finite_indices([]) == []
    for i, value in ((0, float("nan")), (2, float("inf")), (3, float("-inf")), (4, float("nan"))):
        bad = [t.clone() for t in tensors]
        bad[i].view(-1)[-1] = value
        bad[1].view(-1)[0] = float("nan") if i == 0 else 1.0
        assert non_finite_indices(bad) == ([0, 1] if i == 0 else [i])
