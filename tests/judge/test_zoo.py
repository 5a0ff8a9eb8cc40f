"""Quiet when healthy, across architectures: a dozen ``transformers`` families trained
healthy for 40 steps in fp32, bf16 autocast and pure fp16, watched with
``watch(model, optimizer)`` at defaults, raise no warning, no critical and no verdict.

The fast subset of the sweep ``tests/benchmarks/zoo.py`` (every family; its table is in
``docs/zoo.md``). The other side of the rule, real overflows still warned of in time, is
``tests/judge/test_lead.py``.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import normwatch
from tests.benchmarks.zoo import families, train
from tests.conftest import tiny_hf

pytest.importorskip("transformers")

SUBSET = ("llama", "qwen3", "gemma", "mistral", "phi", "gpt2", "t5", "bert", "mamba2",
          "cohere", "olmo2", "vit", "deepseek_v4")
"""The issue's dozen, and DeepSeek V4 (its multi-stream hyper-connection norms alternate
with the blocks' own at another scale: a depth profile that once read as a decay)."""
STEPS = 40


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family", SUBSET)
def test_a_healthy_family_is_quiet(family: str, dtype: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            row = train(family, families()[family], dtype, STEPS)
        finally:
            logging.disable(logging.NOTSET)
    if dtype == "fp16" and row.get("skipped", "").startswith("unsupported"):
        pytest.skip(f"{family}: {row['skipped']}")
    assert "skipped" not in row, row.get("skipped")
    assert row["steps"] == STEPS and row["finite"], row
    assert row["last_loss"] < row["first_loss"]  # it trained
    assert (row["warnings"], row["criticals"], row["verdicts"]) == (0, 0, 0), row["loud"]


def test_the_issues_healthy_fp16_qwen3_is_not_warned_of() -> None:
    """Pure fp16, AdamW, a flush every 2 steps: the final norm's max |x| grows ~10 %/step
    from 1 to past 4 early in training (~38 steps to 256 at that rate). It used to warn;
    under 1/16 of the limit, it is early growth, not a forecast. (The issue's 2e-3 leaves
    the final max at 2.7, 3.3 or 5.7 by the CPU's kernels, AVX512, AVX2 or neither: fp16
    matmuls round by them; at 3e-3 it ends at 7.2-8.4 on each, at most 10.3 on the way.)"""
    torch.manual_seed(0)
    model = tiny_hf("qwen3").half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    with normwatch.watch(model, optimizer, flush_every=2, report_dir=None,
                         report_console=False) as w:
        for _ in range(60):
            loss = model(input_ids=ids, labels=ids).loss
            loss.float().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            w.step(loss)
    assert w.last_snapshot is not None
    assert w.last_snapshot.layers["model.norm"].absmax > 4  # (where it used to warn)
    assert not [a for a in w.alarms if a.severity != "info"]
