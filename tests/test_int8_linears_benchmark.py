"""benchmarks/int8_linears.py on a CPU: its step is the benchmarked Llama's linear layers, its int8 is torchao's,
its integer-operation conversion is exact; and, where Triton is installed, its kernels (in Triton's interpreter
without a GPU) give the reference's outputs. Its timings come from the H200 (docs/benchmarks.md)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import int8_linears

import llm_decode


def test_the_886m_step_is_the_linear_layers_of_the_llama_that_llm_decode_measures():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llm_decode.CONFIG))
    linears = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(int8_linears.step_shapes("886m")) == sorted(linears)


def test_every_int8_value_converts_exactly_through_integer_operations():
    values = torch.arange(-128, 128, dtype=torch.int8)
    assert torch.equal(int8_linears.int8_from_integer_ops(values), values.float())


def test_the_int8_weights_are_torchaos_int8_weight_only():
    torchao = pytest.importorskip("torchao.quantization")
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    linear = torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    linear.weight.data.copy_(weight)
    torchao.quantize_(linear, torchao.Int8WeightOnlyConfig(set_inductor_config=False))
    qdata, scale = int8_linears.quantize(weight)
    assert torch.equal(qdata, linear.weight.qdata)
    torch.testing.assert_close(scale.flatten(), linear.weight.scale.flatten().to(scale.dtype))


KERNELS_AGAINST_THE_REFERENCE = """
    import json, sys, torch
    sys.path.insert(0, {benchmarks!r})
    import _int8_kernels, int8_linears

    device = "cuda" if torch.cuda.is_available() else "cpu"
    errors = {{}}
    for launcher, config in (("launch_cvt", (4, 128, 2, 1)), ("launch_magic", (2, 512, 2, 1))):
        for n, k in ((64, 256), (48, 320)):  # 320: K not a multiple of the step, the masked loads
            qdata, scale = int8_linears.quantize(torch.randn(n, k, device=device))
            qdata[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)  # the byte values' edges
            x = torch.randn(1, k, device=device)
            expected = (x @ qdata.float().t()) * scale
            actual = getattr(_int8_kernels, launcher)(x, qdata, scale, config)
            errors[f"{{launcher}} {{n}}x{{k}}"] = float((actual - expected).abs().max() / expected.abs().max())
    print(json.dumps(errors))
"""


def test_the_triton_gemv_kernels_give_the_reference_outputs(run_python):
    """Without a GPU in Triton's interpreter, which reads ``TRITON_INTERPRET`` when Triton is imported: in a
    process of its own."""
    pytest.importorskip("triton")
    benchmarks = str(Path(int8_linears.__file__).parent)
    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    result = run_python(KERNELS_AGAINST_THE_REFERENCE.format(benchmarks=benchmarks), env=env)
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == 4 and max(errors.values()) < 1e-5, errors
