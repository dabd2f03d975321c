"""Output comparison: elementwise tolerances, and the SQNR a compiler's low-precision rounding may take."""

import torch

import xpupack
from xpupack._compare import mismatch


def rounded_differently(dtype=torch.bfloat16, noise=0.02):
    torch.manual_seed(0)
    expected = torch.randn(4, 256).to(dtype)
    actual = (expected.float() * (1 + noise * torch.randn(4, 256))).to(dtype)  # about 2% off per element
    return actual, expected


def test_low_precision_rounding_passes_on_sqnr_only_where_allowed():
    actual, expected = rounded_differently()
    assert mismatch(actual, expected) is not None  # elementwise: some elements exceed 3e-2
    assert mismatch(actual, expected, low_precision_sqnr_db=30.0) is None
    assert "SQNR 33.8 dB is below 40 dB" in mismatch(actual, expected, low_precision_sqnr_db=40.0)


def test_a_wrong_low_precision_result_still_fails():
    actual, expected = rounded_differently()
    assert mismatch(actual.flip(1), expected, low_precision_sqnr_db=30.0) is not None
    nan = actual.clone()
    nan[0, 0] = float("nan")
    assert mismatch(nan, expected, low_precision_sqnr_db=30.0) is not None


def test_float32_is_always_elementwise():
    actual, expected = rounded_differently(torch.float32)
    assert mismatch(actual, expected, low_precision_sqnr_db=0.0) is not None


def test_inductor_takes_low_precision_rounding_graph_and_eager_do_not():
    expected = torch.linspace(-2, 2, 1024).to(torch.bfloat16)
    actual = expected.clone()
    actual[510:514] += 0.125  # a few elements near zero off by far more than 3e-2; SQNR about 43 dB
    assert xpupack.InductorBackend().compare(actual, expected) is None
    assert xpupack.GraphBackend(base=xpupack.InductorBackend()).compare(actual, expected) is None
    assert xpupack.GraphBackend().compare(actual, expected) is not None
