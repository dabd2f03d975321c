"""Tiny transformers language models (random weights, no downloads) and a decode loop for the tests."""

from __future__ import annotations

import copy
import inspect

import torch

import xpupack
from support.strategies import GRAPH

VOCAB = 128
#: new tokens of the generate() that tunes a tiny model (`tune_llm`)
NEW_TOKENS = 6
#: the size every tiny decoder here shares (each adds what its family needs)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_mistral(seed: int = 0, sliding_window: int | None = None):
    """A tiny Mistral: every layer attends through a sliding window (``None``: the default config's, 4096)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = MistralConfig(**TINY, **window)
    return MistralForCausalLM(config).eval()


def tiny_gemma2(seed: int = 0, sliding_window: int = 8):
    """A tiny Gemma 2: a sliding-window layer, then a full-attention one (its cache mixes both)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(
        **TINY,
        head_dim=16,
        sliding_window=sliding_window,
    )
    return Gemma2ForCausalLM(config).eval()


def tiny_gemma3(seed: int = 0, sliding_window: int = 8):
    """A tiny Gemma 3 text model: a sliding-window layer (local rotary), then a full-attention one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        **TINY,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def prompt(length: int = 8, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator).to(device)


def generate(model, ids: torch.Tensor, new_tokens: int = 6, cache=None, *, eager: bool = False) -> torch.Tensor:
    """Greedy ``generate()`` with a static cache (the caller's, when given); ``eager`` keeps transformers
    from compiling the forward itself (on a GPU it does, with a static cache)."""
    kwargs = {"cache_implementation": "static"} if cache is None else {cache_argument(model): cache}
    if eager:
        kwargs["disable_compile"] = True
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)


def cache_argument(model) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.20) or ``past_key_values``."""
    forward = type(model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def static_cache(model, max_cache_len: int):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def decode_loop(
    model, ids: torch.Tensor, new_tokens: int, cache, *, positions: bool = True, step_logits: list | None = None
) -> torch.Tensor:
    """A hand-written greedy decode loop: one prefill call, then one call per token. ``positions=False``
    passes only the tokens and the cache (the model derives positions and masks from the cache);
    ``step_logits`` collects each decode step's logits."""
    name = cache_argument(model)
    # transformers before 5.20 also takes the positions as `cache_position` (else it derives them on the host)
    positions_too = "cache_position" in inspect.signature(type(model).forward).parameters
    length = ids.shape[1]
    tokens = []

    def step(inputs, at):
        if not positions:
            out = model(input_ids=inputs, **{name: cache}, use_cache=True).logits
        else:
            extra = {"cache_position": at[0]} if positions_too else {}
            out = model(input_ids=inputs, **{name: cache}, use_cache=True, position_ids=at, **extra).logits
        if step_logits is not None and inputs.shape[1] == 1:
            step_logits.append(out)
        return out

    with torch.no_grad():
        logits = step(ids, torch.arange(length, device=ids.device)[None])
        for number in range(new_tokens):
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
            logits = step(token, torch.full((1, 1), length + number, device=ids.device))
    return torch.cat(tokens, dim=1)


def tune_llm(strategy=GRAPH, *, make=tiny_llama, run=None):
    """``(model, reference)``: a tiny language model tuned with ``strategy`` on ``run(model, ids)`` (default:
    a greedy ``generate()`` of `NEW_TOKENS`), and an untuned copy of it to compare with."""
    model = make()
    reference = copy.deepcopy(model)
    xpupack.tune(model, [prompt()], run=run or (lambda m, ids: generate(m, ids, NEW_TOKENS)), strategy=strategy)
    return model, reference


def whole(model):
    """`xpupack.stats` of a model tuned as one unit."""
    return xpupack.stats(model)[""]
