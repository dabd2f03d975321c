"""Output comparison with dtype-aware tolerances: how a candidate earns acceptance.

Exact backends (graph, inductor) are held to elementwise tolerances per dtype.
Backends that change numerics on purpose (quantization) are held to a
signal-to-quantization-noise ratio instead: elementwise tolerances would
either refuse every quantized model or accept broken ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .signature import flatten

# (rtol, atol) per dtype: loose enough for reordered reductions and fused
# kernels, tight enough that a wrong kernel or stale buffer never passes.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
    torch.complex64: (1e-4, 1e-4),
    torch.complex128: (1e-7, 1e-7),
}


#: half-precision dtypes, where a compiler's fusions round differently from eager's op-by-op kernels
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: SQNR (dB) against eager that a bfloat16/float16 output of compiled or replayed code must still reach
#: where it misses the elementwise tolerance. Eager's own rounding sets the scale: on Llama-3-8B's shapes
#: (random weights, 32 layers, a 32-token prefill, H100), eager's bf16 logits are 25.0 dB from float32
#: ones and Inductor's 26.7 dB (closer than eager's), so Inductor's are 24.6 dB from eager's; eager
#: replayed as a CUDA graph is 30.3 dB from eager (cuBLAS picks other kernels under capture). A wrong
#: kernel or a stale buffer lands near 0 dB.
LOW_PRECISION_SQNR_DB = 20.0


def mismatch(
    actual: Any,
    expected: Any,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
    *,
    min_sqnr_db: float | None = None,
    low_precision_sqnr_db: float | None = None,
) -> str | None:
    """Why ``actual`` differs from ``expected`` (trees of tensors and constants), or None if they match.

    Integer and boolean tensors must be equal; floating ones equal within the
    dtype's tolerance, NaNs in the same places. With ``min_sqnr_db``, floating
    tensors are compared by `sqnr_db` instead of elementwise. With
    ``low_precision_sqnr_db``, a bfloat16/float16 tensor that misses the
    elementwise tolerance still passes at that SQNR or above.
    """
    tolerances = tolerances or DEFAULT_TOLERANCES
    actual_leaves, actual_spec = flatten((actual,), {})
    expected_leaves, expected_spec = flatten((expected,), {})
    if actual_spec != expected_spec:
        return "output structure differs from eager"
    for index, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        where = f"output {index}"
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"{where}: eager gives a tensor, candidate a {type(a).__name__}"
            if a.shape != e.shape or a.dtype != e.dtype:
                return f"{where}: eager gives {e.dtype} {tuple(e.shape)}, candidate {a.dtype} {tuple(a.shape)}"
            a, e = a.detach(), e.detach().to(a.device)
            if (e.dtype.is_floating_point or e.dtype.is_complex) and min_sqnr_db is not None:
                problem = _sqnr_problem(a, e, min_sqnr_db)
                if problem:
                    return f"{where}: {problem}"
            elif e.dtype.is_floating_point or e.dtype.is_complex:
                rtol, atol = tolerances.get(e.dtype, (1e-4, 1e-4))
                if not _all_close(a, e, rtol, atol):
                    worst = max(_worst(x, y) for x, y in _chunks(a, e))
                    problem = f"{where}: max abs difference {worst:.3g} exceeds rtol={rtol}, atol={atol}"
                    if low_precision_sqnr_db is None or e.dtype not in LOW_PRECISION:
                        return problem
                    measured = sqnr_db(a.nan_to_num(), e.nan_to_num()) if a.isnan().equal(e.isnan()) else -math.inf
                    if measured < low_precision_sqnr_db:
                        return f"{problem}, and its SQNR {measured:.1f} dB is below {low_precision_sqnr_db:g} dB"
            elif not torch.equal(a, e):
                return f"{where}: values differ from eager"
        elif a != e:
            return f"{where}: eager gives {e!r}, candidate {a!r}"
    return None


#: elements compared at a time: ``torch.allclose`` made temporaries of several times its inputs' size (a
#: load's checks of a 1 GiB input peaked at 6.2 GiB, issue 32), a chunk at a time they stay below ~50 MB
CHUNK_ELEMENTS = 2**21


def _chunks(a: torch.Tensor, e: torch.Tensor):
    """``a`` and ``e`` (one shape) in matching pieces of about `CHUNK_ELEMENTS`, as views (no copy)."""
    if a.dim() == 0 or a.numel() <= CHUNK_ELEMENTS:
        yield a, e
    elif a.is_contiguous() and e.is_contiguous():
        yield from zip(a.view(-1).split(CHUNK_ELEMENTS), e.view(-1).split(CHUNK_ELEMENTS))
    else:  # along the first axis, as views
        rows = max(1, CHUNK_ELEMENTS // max(1, a[0].numel()))
        yield from zip(a.split(rows), e.split(rows))


def _worst(x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest ``|x - y|`` (a NaN counts as infinite), in float64, in place on one copy of ``x``."""
    if x.dtype.is_complex:  # its magnitude: float64 would drop the imaginary part
        return (x - y).abs().double().nan_to_num_(float("inf")).max().item()
    return x.double().sub_(y.double()).abs_().nan_to_num_(float("inf")).max().item()


def _all_close(a: torch.Tensor, e: torch.Tensor, rtol: float, atol: float) -> bool:
    """``torch.allclose(a, e, rtol, atol, equal_nan=True)`` a chunk at a time: ``|a - e| <= atol + rtol·|e|``
    where that difference is finite, else equal values or NaN in both."""
    for x, y in _chunks(a, e):
        difference = (x - y).abs()  # as torch.isclose computes it: real for complex tensors too
        allowed = (y * rtol).abs().add_(atol)
        # an infinite difference is never within tolerance (torch.isclose: only equal infinities are close)
        allowed.nan_to_num_(posinf=torch.finfo(allowed.dtype).max)
        close = difference <= allowed
        if not bool(close.all()):
            close |= x == y
            close |= x.isnan() & y.isnan()
            if not bool(close.all()):
                return False
    return True


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``actual`` against ``expected`` in dB: ``20·log10(‖expected‖ / ‖actual − expected‖)``.

    ``inf`` when they are equal; 30 dB means a relative RMS error of about 3%.
    """
    expected = expected.double()
    noise = (actual.double() - expected).norm().item()
    if noise == 0:
        return math.inf
    signal = expected.norm().item()
    return 20 * math.log10(signal / noise) if signal else -math.inf


def _sqnr_problem(actual: torch.Tensor, expected: torch.Tensor, min_sqnr_db: float) -> str | None:
    nan = expected.isnan()
    if not torch.equal(actual.isnan(), nan):
        return "NaNs in other places than eager's"
    ratio = sqnr_db(actual[~nan], expected[~nan])
    if ratio < min_sqnr_db:
        return f"SQNR {ratio:.1f} dB against eager, below the {min_sqnr_db:g} dB required"
    return None
