"""How far low-precision rounding alone moves a language model's logits: the scale of xpupack's SQNR floor.

A Llama-shaped model with random weights (Llama-3-8B's shapes by default), one prefill of ``--prompt``
tokens, batch 1. The logits of eager in ``--dtype``, of eager replayed as a device graph (CUDA only), and
of ``torch.compile`` (Inductor) are compared with each other and with eager in float32 (the same weights,
upcast), as SQNR in dB (`xpupack._compare.sqnr_db`; higher is closer) and the share of positions whose
argmax agrees with eager's. xpupack accepts a compiled or replayed candidate's bfloat16/float16 outputs
down to `xpupack._compare.LOW_PRECISION_SQNR_DB` from eager's; this shows what eager's own rounding is.

It prints one JSON object: the settings, ``device_name``, ``torch``, ``transformers``, ``floor_db`` (that
constant) and ``sqnr_db`` (pair -> dB: ``graph_vs_eager``, ``inductor_vs_eager``, ``eager_vs_float32``,
``inductor_vs_float32``), ``inductor_argmax_agreement`` and ``seconds``.

    python benchmarks/low_precision_rounding.py                            # Llama-3-8B shapes on a GPU
    python benchmarks/low_precision_rounding.py --device cpu --layers 2 --hidden 64 --intermediate 128 \\
        --vocab 256 --heads 4 --kv-heads 2 --prompt 8                      # a smoke test on a CPU

Measured on an H100 (torch 2.11, transformers 5.17), 32 layers, bf16, a 32-token prefill: graph vs eager
30.3 dB, Inductor vs eager 24.6 dB, eager vs float32 25.0 dB, Inductor vs float32 26.7 dB, argmax
agreement 0.72 (random weights leave near ties) (docs/tuning.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from xpupack._compare import LOW_PRECISION_SQNR_DB, sqnr_db

LLAMA3_8B = {"layers": 32, "hidden": 4096, "intermediate": 14336, "vocab": 128256, "heads": 32, "kv_heads": 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--prompt", type=int, default=32)
    for name, value in LLAMA3_8B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args()
    started = time.perf_counter()
    print(json.dumps({**vars(args), **measure(args), "seconds": round(time.perf_counter() - started, 1)}))


def measure(args: argparse.Namespace) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    ids = torch.randint(0, args.vocab, (1, args.prompt), device=args.device)
    found: dict = {
        "benchmark": "low_precision_rounding",
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "floor_db": LOW_PRECISION_SQNR_DB,
    }
    sqnr: dict[str, float] = {}
    with torch.inference_mode():
        eager = model(ids).logits.float()
        if args.device.startswith("cuda"):
            sqnr["graph_vs_eager"] = sqnr_db(replayed(model, ids), eager)
        compiled = torch.compile(model)(ids).logits.float()
        sqnr["inductor_vs_eager"] = sqnr_db(compiled, eager)
        found["inductor_argmax_agreement"] = (compiled.argmax(-1) == eager.argmax(-1)).float().mean().item()
        truth = model.float()(ids).logits
        sqnr["eager_vs_float32"] = sqnr_db(eager, truth)
        sqnr["inductor_vs_float32"] = sqnr_db(compiled, truth)
    found["sqnr_db"] = {pair: round(value, 2) for pair, value in sqnr.items()}
    return found


def replayed(model, ids) -> torch.Tensor:
    """The logits of eager recorded once as a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(ids)  # warm-up outside the capture (lazy initialisation, cuBLAS handles)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model(ids).logits
    graph.replay()
    torch.cuda.synchronize()
    return logits.float()


if __name__ == "__main__":
    main()
