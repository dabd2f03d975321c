"""Comparing a tuned module's call with eager's: the same result, or the same error."""

from __future__ import annotations

import torch

from xpupack._compare import DEFAULT_TOLERANCES


def outcome(call):
    """``("ok", result)`` or ``("error", (type, message))`` of ``call()``."""
    try:
        return "ok", call()
    except Exception as exc:
        return "error", (type(exc), str(exc))


def assert_same_outcome(got, expected):
    """The same error, or the same tensor: dtype, shape, device, autograd, NaN/inf places, signs of zeros,
    values within the tolerance backends are accepted with (a transposed input may round differently)."""
    assert got[0] == expected[0], (got, expected)
    if got[0] == "error":
        assert got[1] == expected[1]
        return
    a, e = got[1], expected[1]
    assert (a.shape, a.dtype, a.device, a.requires_grad) == (e.shape, e.dtype, e.device, e.requires_grad)
    if a.device.type == "meta":
        return
    rtol, atol = DEFAULT_TOLERANCES.get(e.dtype, (0, 0))
    assert torch.allclose(a.detach(), e.detach(), rtol=rtol, atol=atol, equal_nan=True)
    zeros = e == 0
    assert torch.equal(a.detach()[zeros].signbit(), e.detach()[zeros].signbit())
