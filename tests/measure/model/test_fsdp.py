"""FSDP2 (``fully_shard``) on a tiny ``transformers`` Llama: two real gloo ranks on the CPU.

Each rank trains its own batch, eager, with every decoder layer compiled and with the whole
model compiled. Per rank, the statistics equal an unsharded replica fed the same batch
(the weight gradients of compiled blocks included, with no recompile after the first
step); combined across ranks
they equal one process over both batches; weight dtypes are read from the unsharded
parameter (bf16 under a bf16 ``MixedPrecisionPolicy``, while the shards stay fp32).
The optimizer's step is measured per rank: under FSDP2 each rank's shard (the shards
add up to one process stepping on both batches), under DDP the whole, reduced model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import normwatch
from normwatch.catalog import PUBLIC
from normwatch.export.crossrank import combine_ranks
from tests.factory import two_ranks

STEPS = 2


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config)


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * rank + step)
    return torch.randint(0, 128, (2, 12), generator=g)


def train(model: torch.nn.Module, rank: int, watch: normwatch.Watch, run: Any = None,
          ) -> dict[str, dict[str, Any]]:
    """Forward and backward ``STEPS`` batches of ``rank`` (no optimizer: every variant
    sees the same weights); the per-layer statistics of one flush."""
    from torch._dynamo.utils import counters

    run = model if run is None else run
    graphs = [counters["stats"]["unique_graphs"]]
    for step in range(STEPS):
        if step == 1:
            graphs.append(counters["stats"]["unique_graphs"])
        tokens = batch(rank, step)
        run(input_ids=tokens, labels=tokens).loss.backward()
        watch.step()
    snap = watch.flush()
    stats = {n: {f: getattr(s, f) for f in (*PUBLIC, "weight_dtype", "input_dtype")}
             for n, s in snap.layers.items()}
    graphs.append(counters["stats"]["unique_graphs"])
    stats["graphs"] = {"first step": graphs[1] - graphs[0], "after": graphs[2] - graphs[1]}
    return stats


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for variant in ("eager", "compiled", "whole", "bf16"):
        torch.compiler.reset()
        model = llama()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if variant == "bf16" \
            else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        w = normwatch.watch(model, flush_every=100, stats_every=1, report_dir=None,
                            prometheus_aggregate=True, rank=rank)
        if variant == "compiled":
            for layer in model.model.layers:
                layer.compile()
        result[variant] = train(model, rank, w, torch.compile(model) if variant == "whole"
                                else None)
        if variant == "eager":  # the raw rows combined over both ranks
            for step in range(STEPS):
                tokens = batch(rank, step)
                model(input_ids=tokens, labels=tokens).loss.backward()
            rows, _ = w._measure.read()
            combined = w._measure.snapshot(combine_ranks(rows), STEPS, 1)
            result["combined"] = {n: {f: getattr(s, f) for f in PUBLIC}
                                  for n, s in combined.layers.items()}
        result[f"{variant}_shard_dtype"] = str(
            next(model.parameters()).dtype).removeprefix("torch.")
        w.close()
    for variant in ("fsdp_step", "ddp_step"):
        result[variant] = one_step(rank, variant)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


LR = 0.5


GRAD_FIELDS = ("grad_out_rms", "grad_out_absmax", "grad_in_rms", "grad_hidden_rms",
               "grad_gain", "weight_grad_norm")


def one_step(rank: int, variant: str) -> dict[str, Any]:
    """One SGD step on the rank's batch, FSDP2-sharded or DDP-wrapped: the watch's
    ``[grad_norm, update_norm, param_norm]`` and the norms' gradient statistics."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = llama()
    if variant == "fsdp_step":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    w = normwatch.watch(model, opt, flush_every=100, stats_every=1, report_dir=None)
    tokens = batch(rank, 0)
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    w.step()
    snap = w.flush()
    (u,) = snap.updates
    w.close()
    return {"update": [u.grad_norm, u.update_norm, u.param_norm],
            "grads": {n: {f: getattr(s, f) for f in GRAD_FIELDS}
                      for n, s in snap.layers.items()}}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return two_ranks(_worker, tmp_path_factory.mktemp("fsdp"))


def replica(ranks_fed: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """An unsharded model, one process, fed the batches of ``ranks_fed``."""
    model = llama()
    w = normwatch.watch(model, flush_every=100, stats_every=1, report_dir=None)
    for rank in ranks_fed:
        for step in range(STEPS):
            tokens = batch(rank, step)
            model(input_ids=tokens, labels=tokens).loss.backward()
    stats = {n: {f: getattr(s, f) for f in PUBLIC} for n, s in w.flush().layers.items()}
    w.close()
    return stats


def same(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], rel: float) -> None:
    assert got.keys() == want.keys() and got
    for name, stats in want.items():
        for field, value in stats.items():
            if field in ("output_mismatch", "output_eps"):  # measured in checked intervals
                continue
            if isinstance(value, float):
                assert got[name][field] == pytest.approx(value, rel=rel, abs=1e-6), \
                    (name, field)
            else:
                assert got[name][field] == value, (name, field)


@pytest.mark.parametrize("variant", ["eager", "compiled", "whole"])
def test_each_rank_equals_an_unsharded_replica(ranks: list[dict[str, Any]],
                                               variant: str) -> None:
    for rank, result in enumerate(ranks):
        want = replica((rank,))
        # compiled whole, torch.compile's wrapper runs the root's hooks as eager frames
        # (never compiled: measure.compiling.eager_frame): the watch finds the unsharded
        # weights before the first backward, as in eager
        # no graph compiled after the first step (the weight hooks moved in between)
        graphs = result[variant].pop("graphs")
        assert graphs["after"] == 0 and (graphs["first step"] > 0) == (variant != "eager")
        same(result[variant], want, rel=1e-4)
        # compiled blocks: the weight hooks moved onto FSDP2's unsharded weights after the
        # first step, which they did not see
        assert all(s["weight_grad_norm"] is not None for s in result[variant].values())
        assert result[variant]["model.norm"]["calls"] == STEPS


def test_combined_across_ranks_equals_one_process_over_both(ranks: list[dict[str, Any]]
                                                              ) -> None:
    both = replica((0, 1))
    for result in ranks:
        same(result["combined"], both, rel=1e-4)
        assert result["combined"]["model.norm"]["tokens"] == 2 * STEPS * 2 * 12


def test_weight_dtype_is_the_unsharded_parameters(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["bf16_shard_dtype"] == "float32"  # the sharded parameters
        layer = result["bf16"]["model.layers.0.input_layernorm"]
        assert (layer["weight_dtype"], layer["input_dtype"]) == ("bfloat16", "bfloat16")
        assert result["eager"]["model.norm"]["weight_dtype"] == "float32"


def test_optimizer_steps_per_rank_under_fsdp2_and_ddp(ranks: list[dict[str, Any]]) -> None:
    # the reference: one unsharded model stepping on the mean loss of both ranks' batches
    # (FSDP2 and DDP average the ranks' gradients), norms in float64 one tensor at a time
    model = llama()
    before = [p.detach().double().clone() for p in model.parameters()]
    losses = [model(input_ids=batch(r, 0), labels=batch(r, 0)).loss for r in (0, 1)]
    (sum(losses) / 2).backward()  # type: ignore[operator]
    grad = sum(float(p.grad.double().square().sum()) for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=LR).step()
    update = sum(float((p.detach().double() - b).square().sum())
                 for p, b in zip(model.parameters(), before, strict=True))
    param = sum(float(p.detach().double().square().sum()) for p in model.parameters())
    want = [grad**0.5, update**0.5, param**0.5]
    # gradient and parameter norms exact; the update's estimated from every 37th block
    # (updates.SAMPLE_STRIDE; the shards sample their own elements)
    tolerance = [1e-5, 5e-2, 1e-5]  # a tiny model whose SGD update is its sparse gradient
    for result in ranks:  # DDP: every rank holds the reduced gradient and the whole model
        for got, value, rel in zip(result["ddp_step"]["update"], want, tolerance, strict=True):
            assert got == pytest.approx(value, rel=rel)
    shards = [result["fsdp_step"]["update"] for result in ranks]  # FSDP2: each rank its shard
    for i, rel in enumerate(tolerance):
        assert sum(s[i] ** 2 for s in shards) ** 0.5 == pytest.approx(want[i], rel=rel)
    assert all(0 < s[0] < want[0] for s in shards)


def test_norm_gradients_are_each_ranks_own_before_the_reduction(ranks: list[dict[str, Any]]
                                                                ) -> None:
    """Under DDP and FSDP2 a rank's gradient statistics (the weight's included) are those
    of its own batch, before the all-reduce / reduce-scatter averages them."""
    for rank, result in enumerate(ranks):
        model = llama()
        w = normwatch.watch(model, flush_every=100, stats_every=1, report_dir=None)
        tokens = batch(rank, 0)
        model(input_ids=tokens, labels=tokens).loss.backward()
        want = {n: {f: getattr(s, f) for f in GRAD_FIELDS} for n, s in w.flush().layers.items()}
        w.close()
        other = ranks[1 - rank]["ddp_step"]["grads"]["model.norm"]["grad_out_rms"]
        assert other != pytest.approx(want["model.norm"]["grad_out_rms"], rel=1e-3)
        for variant in ("ddp_step", "fsdp_step"):
            got = result[variant]["grads"]
            assert got.keys() == want.keys()
            for name, fields in want.items():
                for field, value in fields.items():
                    assert value is not None, (name, field)
                    assert got[name][field] == pytest.approx(value, rel=1e-4), \
                        (variant, name, field)
