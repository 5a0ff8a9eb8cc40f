"""Shared fixtures: tiny models and a deterministic seed for every test."""

from __future__ import annotations

import os
import shutil
import warnings

# Without a GPU, Triton kernels run in Triton's interpreter (set before triton is imported).
if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _no_compiled_code() -> None:
    """Each test file starts with no code compiled by another (the suite runs in workers,
    a file at a time, in an order that depends on timing: a class compiled by an earlier
    file before that worker's first watch would make ``watch()`` warn that the model was
    compiled before it)."""
    torch.compiler.reset()


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*token_id must be.*")
        yield


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def tiny_hf(name: str) -> torch.nn.Module:
    """A tiny random-config ``transformers`` model (no downloads)."""
    import transformers as t

    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**SMALL))
    if name == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**SMALL, head_dim=8))
    if name == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(**SMALL, head_dim=8))
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                              n_positions=64, bos_token_id=0, eos_token_id=0))
    if name == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
            num_heads=4))
    if name == "bert":
        return t.BertForMaskedLM(t.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64))
    raise KeyError(name)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reports default to ./normwatch-reports: keep every test's in its own folder."""
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
