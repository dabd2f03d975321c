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


COMPILED_OR_REPLAYED = {
    "inductor": xpupack.InductorBackend(),
    "graph+inductor": xpupack.GraphBackend(base=xpupack.InductorBackend()),
    "graph": xpupack.GraphBackend(),  # a replay runs other kernels (cuBLAS picks others under capture)
}


def test_compiled_and_replayed_code_take_low_precision_rounding_down_to_the_floor():
    """Eager's own bf16 rounding sets the scale: an 8B Llama's logits are 25 dB from float32 ones, so a
    compiled candidate's are under 25 dB from eager's (xpupack._compare.LOW_PRECISION_SQNR_DB)."""
    expected = torch.linspace(-2, 2, 1024).to(torch.bfloat16)
    actual = expected.clone()
    actual[510:514] += 0.125  # a few elements near zero off by far more than 3e-2; SQNR about 43 dB
    deep_rounding, _ = rounded_differently(noise=0.08)  # about 22 dB: what 32 bf16 layers leave
    far_off, _ = rounded_differently(noise=0.15)  # about 16.5 dB: more than rounding
    _, rounded_expected = rounded_differently()
    for name, backend in COMPILED_OR_REPLAYED.items():
        assert backend.compare(actual, expected) is None, name
        assert backend.compare(deep_rounding, rounded_expected) is None, name
        assert "is below 20 dB" in backend.compare(far_off, rounded_expected), name


def test_comparing_large_outputs_takes_memory_of_a_chunk_not_of_their_size(run_python):
    """A load's checks of a 1 GiB input peaked at 6.2 GiB (issue 32): ``torch.allclose`` made temporaries of
    several times its inputs' size; a check compares a chunk at a time. Measured in a fresh process as the
    growth of its peak resident memory while two 256 MiB outputs are compared, agreeing and not."""
    result = run_python(
        """
        import resource, torch
        from xpupack._compare import mismatch

        expected = torch.randn(64 * 2**20, generator=torch.Generator().manual_seed(0))
        actual = expected + 1e-6
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert mismatch(actual, expected) is None
        actual[12345] += 1
        assert "max abs difference 1" in mismatch(actual, expected)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
        """
    )
    # MiB, for 512 MiB of outputs: 83-107 measured (allocator pages), torch.allclose 1,088
    assert int(result.stdout) < 200


def test_the_chunked_comparison_agrees_with_torch_allclose(monkeypatch):
    """Chunks of 7 elements over every pair of special values (NaN, infinities, huge, near) and random
    tensors, contiguous or not, in each floating dtype."""
    import itertools

    from xpupack import _compare

    monkeypatch.setattr(_compare, "CHUNK_ELEMENTS", 7)
    values = [0.0, 1.0, -1.0, 1e-5, 1.00005, float("nan"), float("inf"), float("-inf"), 1e30, 3e38]
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64):
        pairs = [
            (torch.tensor([x] * 9, dtype=dtype).view(3, 3), torch.tensor([y] * 9, dtype=dtype).view(3, 3))
            for x, y in itertools.product(values, repeat=2)
        ]
        for _ in range(20):
            a = torch.randn(5, 11, generator=generator).to(dtype)
            e = (
                a.to(torch.complex128 if dtype.is_complex else torch.float64)
                + 1e-4 * torch.randn(5, 11, generator=generator)
            ).to(dtype)
            pairs += [(a, e), (a.t(), e.t())]
        for (a, e), (rtol, atol) in itertools.product(pairs, [(1e-4, 1e-4), (3e-2, 3e-2), (0.0, 0.0)]):
            assert _compare._all_close(a, e, rtol, atol) == torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
