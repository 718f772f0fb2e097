"""Cost model fit: recovers known coefficients, never negative, calibrates a real encoder."""

import pytest

from kimi_encoder.cost import CostModel, calibrate
from kimi_encoder.encoder import VisionEncoder


@pytest.mark.parametrize(
    ("a", "b", "c"),
    [(2e-9, 1e-6, 1e-3), (0.0, 5e-6, 0.0), (1e-8, 0.0, 2e-3)],
    ids=["all-terms", "linear-only", "no-linear"],
)
def test_fit_recovers_coefficients(a, b, c):
    samples = [(p, a * p * p + b * p + c) for p in (16, 64, 256, 1024, 4096)]
    m = CostModel.fit(samples)
    for got, want in zip((m.a, m.b, m.c), (a, b, c), strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)


def test_fit_never_negative():
    # Decreasing per-patch time would fit a negative term; NNLS keeps all terms >= 0.
    m = CostModel.fit([(16, 1.0), (64, 0.9), (256, 0.8)])
    assert min(m.a, m.b, m.c) >= 0
    assert m(100) > 0


def test_patches_model_is_identity():
    assert CostModel.patches()(1234) == 1234


def test_fit_needs_samples():
    with pytest.raises(ValueError, match="without samples"):
        CostModel.fit([])


def test_calibrate_real_encoder():
    """Timings vary on a busy machine; what holds is what the fit guarantees: no negative
    term, so the cost never falls as images grow."""
    enc = VisionEncoder.from_pretrained("tiny", device="cpu")
    m = calibrate(enc.time_forward, grids=(4, 16, 32), repeats=1)
    assert min(m.a, m.b, m.c) >= 0
    assert m.a + m.b + m.c > 0
    assert m(32 * 32) >= m(16 * 16) >= m(4 * 4)
