"""The ``transformers`` zoo in miniature: each family's default config with the usual size
fields shrunk (no downloads), built and fed a batch. Shared by the family test
(``tests/measure/layer/test_architectures.py``) and the false-alarm sweep
(``tests/benchmarks/zoo.py``).

    >>> model = tiny("llama", "LlamaForCausalLM")
    >>> loss = model(**inputs("llama", model.config, batch()), use_cache=False).loss

A family that cannot be shrunk or built this way raises ``pytest.skip`` with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

SIZES = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, d_model=32, num_layers=2, num_heads=4,
    d_ff=64, ffn_dim=64, n_inner=64, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
    decoder_ffn_dim=64, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
    rotary_dim=8,  # GPT-J, CodeGen: rotary dims within the 8-wide heads
)
DERIVED = ("head_dim", "num_key_value_heads")
"""Size fields a default config leaves ``None`` (derived later, or by the model): set."""
MAX_PARAMS = 20_000_000
# Families the sweep cannot run, and why (each checked by hand on this transformers).
SKIP = {
    "gemma3n": "Gemma3nForConditionalGeneration builds a timm vision tower (timm is not "
               "installed); its text model is the gemma3n_text family",
    "gemma4_assistant": "a draft model for assisted decoding whose default config fails "
                        "its own validation (hidden_size_per_layer_input must be 0, got "
                        "256)",
    "gemma4_unified_assistant": "a draft model for assisted decoding: its forward needs the "
                                "target model's shared KV states and inputs_embeds "
                                "('inputs_embeds and shared_kv_states cannot be None')",
}

# Families whose size fields go by other names or must agree with each other: set after
# the shrink ("a.b": a sub-config's field; "config": build from that sub-config;
# "rebuild": construct the config again from its fields, so that it derives the rest).
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
_GEMMA3N = dict(intermediate_size=[64, 64], num_kv_shared_layers=0, laurel_rank=4,
                activation_sparsity_pattern=[0.0, 0.0], sliding_window=8, altup_num_inputs=2)
_DSA = dict(index_head_dim=8, index_n_heads=4, index_topk=8, num_key_value_heads=4,
            qk_head_dim=8)  # MLA with an indexer: heads as many as KV heads, dims 4 + 4
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": dict(head_dim=16, n_groups=1, state_size=16, chunk_size=16),  # 4 x 16 = 2 x 32
    "bamba": _MAMBA,
    "granitemoehybrid": _MAMBA,
    "zamba2": dict(n_mamba_heads=4, mamba_d_state=16, chunk_size=16, rebuild=True,
                   layers_block_type=["linear_attention", "hybrid"]),
    "deepseek_v2": dict(num_experts_per_tok=2, n_group=1, topk_group=1, n_routed_experts=4),
    "marian": dict(decoder_vocab_size=128),
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    "hy_v4": _DSA,
    "axk2": _DSA,
    "axk1": dict(n_group=1, topk_group=1, num_key_value_heads=4, qk_head_dim=8),
    "deepseek_v4": dict(head_dim=32, qk_rope_head_dim=4, o_groups=2, o_lora_rank=16,
                        index_n_heads=4, index_head_dim=8, index_topk=8, sliding_window=8),
    "dbrx": {"attn_config.clip_qkv": 8.0, "attn_config.rope_theta": 10000.0,
             "ffn_config.ffn_hidden_size": 64},
    "dots1": dict(n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(qk_head_dim=8, zero_expert_num=2, num_key_value_heads=4),
    "cohere_compass_text": dict(rope_parameters={
        t: {"rope_theta": 10000.0, "rope_type": "default"}
        for t in ("full_attention", "sliding_attention")}),
    "gemma3n_text": _GEMMA3N,
    "xlstm": dict(embedding_dim=32, num_blocks=2, chunk_size=16, ffn_round_up_to_multiple_of=16),
    "musicgen": dict(config="decoder"),  # the causal LM is the audio-token decoder
    "musicgen_melody": dict(config="decoder"),
    "git": {"vision_config.image_size": 32},
    "blt": {"encoder_hash_byte_group_vocab": 512, "local_attention_window_len": 16,
            **{f"{c}.hidden_size_global": 32 for c in ("encoder_config", "decoder_config")},
            **{f"{c}cross_attn_k": 1 for c in ("", "encoder_config.", "decoder_config.")}},
    "t5": dict(decoder_start_token_id=0),  # (not in the default config)
    "vit": dict(image_size=32, patch_size=8),
    "reformer": dict(attention_head_size=8, attn_layers=["local", "lsh"],
                     axial_pos_shape=(4, 4), axial_pos_embds_dim=(16, 16),
                     feed_forward_size=64, local_attn_chunk_length=8,
                     lsh_attn_chunk_length=8, num_buckets=2),
}


def override(config: Any, model_type: str) -> Any:
    """Apply the family's :data:`OVERRIDES`; returns the config to build from."""
    fields = dict(OVERRIDES.get(model_type, {}))
    sub = fields.pop("config", None)
    rebuild = fields.pop("rebuild", False)
    if sub is not None:
        config = getattr(config, sub)
    for key, value in fields.items():
        *path, name = key.split(".")
        target = config
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    if rebuild:  # fields the config derives when built (from the shrunk sizes now)
        declared = {f.name for f in dataclasses.fields(config)}
        config = type(config)(**{k: v for k, v in config.to_dict().items() if k in declared})
    return config


def shrink(config: object, depth: int = 0) -> None:
    """Set the usual size fields of ``config`` and its sub-configs (text, vision, ...)."""
    for key, value in SIZES.items():
        # read-only properties, per-layer attributes: leave them to the config
        with contextlib.suppress(Exception):
            current = getattr(config, key, None)
            unset = current is None and key in DERIVED and hasattr(config, key)
            if unset or (isinstance(current, int) and not isinstance(current, bool)):
                setattr(config, key, value)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(getattr(config, "layer_types", None), list) and isinstance(layers, int):
        with contextlib.suppress(Exception):  # one entry per layer
            config.layer_types = config.layer_types[:layers]  # type: ignore[attr-defined]
    if isinstance(getattr(config, "qk_rope_head_dim", None), int) and \
            isinstance(getattr(config, "head_dim", None), int):
        config.head_dim = config.qk_rope_head_dim  # type: ignore[attr-defined]  # MLA: rope dims
    for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        current = getattr(config, key, None)  # special tokens inside the shrunk vocabulary
        if isinstance(current, int) and current >= SIZES["vocab_size"]:
            with contextlib.suppress(Exception):
                setattr(config, key, value)
    if isinstance(getattr(config, "is_decoder", None), bool):
        config.is_decoder = True  # type: ignore[attr-defined]  # a causal LM head's decoder
    if hasattr(config, "initializer_range"):
        config.initializer_range = 0.2  # type: ignore[attr-defined]  # width-32 activations
    for sub in list(vars(config).values()) if depth < 2 else []:
        if isinstance(sub, transformers.PretrainedConfig):
            shrink(sub, depth + 1)


def tiny(model_type: str, class_name: str) -> torch.nn.Module:
    """The family's model with its size fields shrunk; ``pytest.skip`` where it cannot be."""
    if model_type in SKIP:
        pytest.skip(f"{model_type}: {SKIP[model_type]}")
    try:
        config = CONFIG_MAPPING[model_type]()
        shrink(config)
        config = override(config, model_type)
        cls = getattr(transformers, class_name)
        with torch.device("meta"):
            try:
                params = sum(p.numel() for p in cls(config).parameters())
            except AttributeError:  # a multimodal config: the causal LM takes its text part
                text = config.get_text_config()  # type: ignore[attr-defined]
                if text is config:
                    raise
                config = text
                params = sum(p.numel() for p in cls(config).parameters())
        if params > MAX_PARAMS:
            pytest.skip(f"{model_type}: {params / 1e6:.0f}M parameters after shrinking the usual "
                        "size fields")
        torch.manual_seed(0)
        model: torch.nn.Module = cls(config)
        languages = getattr(config, "languages", None)
        if hasattr(model, "set_default_language") and languages:  # X-MOD: one adapter set
            model.set_default_language(languages[0])
        return model
    except pytest.skip.Exception:
        raise
    except Exception as exc:
        pytest.skip(f"{model_type}: does not build from a shrunk default config: "
                    f"{type(exc).__name__}: "
                    f"{str(exc)[:120]}")


def _codebooks(config: Any, ids: torch.Tensor) -> dict[str, Any]:
    """MusicGen decoders: one row of ids per codebook, labels (batch, seq, codebooks)."""
    n = config.num_codebooks
    rows = ids.repeat_interleave(n, 0)
    return dict(input_ids=rows, labels=rows.reshape(len(ids), n, -1).transpose(1, 2))


def _with_image(config: Any, ids: torch.Tensor) -> dict[str, Any]:
    """GIT: a captioning model, its loss taken after the image tokens."""
    size = config.vision_config.image_size
    pixels = torch.randn(len(ids), 3, size, size, generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids, pixel_values=pixels)


# Families whose causal LM takes more than token ids (the default: ids as labels too).
INPUTS = {"musicgen": _codebooks, "musicgen_melody": _codebooks, "git": _with_image}



def batch() -> torch.Tensor:
    """Token ids (2 x 16) inside the shrunk vocabulary, the same on every call."""
    return torch.randint(3, SIZES["vocab_size"], (2, 16),
                         generator=torch.Generator().manual_seed(0))


def inputs(model_type: str, config: Any, ids: torch.Tensor) -> dict[str, Any]:
    """The family's forward arguments for ``ids`` (by default the ids, and as labels)."""
    return INPUTS.get(model_type, lambda config, ids: dict(input_ids=ids, labels=ids))(
        config, ids)
