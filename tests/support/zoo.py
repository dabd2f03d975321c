"""The zoo: one tiny random model (no downloads) of each family the docs name, by family name.

Decoders share `TINY`'s size (2 layers, hidden 64, vocab 128) plus what their family needs; encoders are
as small. A maker takes a ``seed`` (the weights) and returns the model in eval mode.
"""

from __future__ import annotations

import torch

from support.language_models import TINY, VOCAB, tiny_gemma2, tiny_gemma3, tiny_gpt2, tiny_llama, tiny_mistral

#: what a family with a head size of its own sets (hidden 64 over 4 heads)
HEAD = dict(head_dim=16)
#: a mixture of experts: few and small
EXPERTS = dict(num_experts_per_tok=2)
#: `TINY` for the families that name their feed-forward size their own way and have no KV-head count
NO_KV_HEADS = {key: value for key, value in TINY.items() if key not in ("intermediate_size", "num_key_value_heads")}


def _tiny(config_name: str, model_name: str, **config):
    """A maker of ``transformers.<model_name>`` built from ``transformers.<config_name>(**config)``, seeded."""

    def make(seed: int = 0):
        import transformers

        torch.manual_seed(seed)
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config)).eval()

    return make


#: decoder family -> maker; every one is tuned through `generate()` with a static cache
DECODERS = {
    "llama": tiny_llama,
    "mistral": tiny_mistral,
    "qwen2": _tiny("Qwen2Config", "Qwen2ForCausalLM", **TINY),
    "qwen3": _tiny("Qwen3Config", "Qwen3ForCausalLM", **TINY, **HEAD),
    "qwen3-moe": _tiny(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **TINY, **HEAD, **EXPERTS, num_experts=4, moe_intermediate_size=32
    ),
    "gemma": _tiny("GemmaConfig", "GemmaForCausalLM", **TINY, **HEAD),
    "gemma2": tiny_gemma2,
    "gemma3": tiny_gemma3,
    "phi3": _tiny("Phi3Config", "Phi3ForCausalLM", **TINY),
    "gpt2": tiny_gpt2,
    "gpt-neox": _tiny("GPTNeoXConfig", "GPTNeoXForCausalLM", **NO_KV_HEADS, intermediate_size=128),
    "opt": _tiny("OPTConfig", "OPTForCausalLM", **NO_KV_HEADS, word_embed_proj_dim=64, ffn_dim=128),
    "falcon": _tiny("FalconConfig", "FalconForCausalLM", **NO_KV_HEADS),
    "stablelm": _tiny("StableLmConfig", "StableLmForCausalLM", **TINY),
    "granite": _tiny("GraniteConfig", "GraniteForCausalLM", **TINY),
    "olmo2": _tiny("Olmo2Config", "Olmo2ForCausalLM", **TINY),
    "smollm3": _tiny("SmolLM3Config", "SmolLM3ForCausalLM", **TINY),
    "mixtral": _tiny("MixtralConfig", "MixtralForCausalLM", **TINY, **EXPERTS, num_local_experts=4),
}


#: the size every tiny text encoder here shares
ENCODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def tiny_whisper_encoder(seed: int = 0):
    """Whisper's encoder alone (what serves audio features): 16 mel bins, 64 frames (32 positions)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(seed)
    config = WhisperConfig(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
    )
    return WhisperEncoder(config).eval()


def tokens(seed: int) -> dict:
    """A text encoder's usual call: two sequences of 12 tokens, the second padded after 9."""
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def pixels(seed: int) -> dict:
    """ViT's usual call: two 32x32 RGB images."""
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))}


def audio_features(seed: int) -> dict:
    """Whisper's encoder's usual call: two log-mel spectrograms of 64 frames."""
    return {"input_features": torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(seed))}


#: encoder family -> (maker, its usual call's inputs for a seed); each is tuned through ``model(**inputs)``
ENCODERS = {
    "bert": (_tiny("BertConfig", "BertModel", vocab_size=VOCAB, max_position_embeddings=64, **ENCODER), tokens),
    # RoBERTa's positions start after its padding token (1): two more than the longest sequence
    "roberta": (
        _tiny("RobertaConfig", "RobertaModel", vocab_size=VOCAB, max_position_embeddings=66, pad_token_id=1, **ENCODER),
        tokens,
    ),
    "distilbert": (
        _tiny(
            "DistilBertConfig",
            "DistilBertModel",
            vocab_size=VOCAB,
            dim=64,
            n_layers=2,
            n_heads=4,
            hidden_dim=128,
            max_position_embeddings=64,
        ),
        tokens,
    ),
    "vit": (_tiny("ViTConfig", "ViTModel", image_size=32, patch_size=8, **ENCODER), pixels),
    "whisper-encoder": (tiny_whisper_encoder, audio_features),
}
