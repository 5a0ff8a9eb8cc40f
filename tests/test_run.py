"""``normwatch run -- python SCRIPT``: scripts that never import normwatch, run as
subprocesses, each with a planted fault that must produce alarms and a post-mortem."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from normwatch.config import SETTINGS, WatchConfig, option_defaults, options_from_env
from normwatch.errors import ConfigError

SCRIPT = Path(sys.executable).parent / "normwatch"

PLAIN = """
import torch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
torch.manual_seed(0)
model = TinyLM(dim=32, depth=2)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(0)
for step in range(1, 13):
    model.blocks[1].mlp.fault = step >= 8          # a NaN born in block 1's MLP
    tokens = synthetic_batch(gen, batch=4, seq=16)
    loss = lm_loss(model(tokens), tokens)
    loss.backward(); opt.step(); opt.zero_grad()
print("script finished")
"""

LIGHTNING = """
import warnings
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
warnings.filterwarnings("ignore")

class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyLM(dim=32, depth=2)
    def training_step(self, batch, i):
        self.model.blocks[1].mlp.fault = self.trainer.global_step + 1 >= 6
        return lm_loss(self.model(batch), batch)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

data = DataLoader(synthetic_batch(torch.Generator().manual_seed(0), batch=64, seq=16),
                  batch_size=4)
pl.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_checkpointing=False,
           enable_progress_bar=False, enable_model_summary=False).fit(Lit(), data)
print("script finished")
"""

HF = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4))
calls = []
def plant(module, args, output):                   # layer 0's MLP emits inf from step 5
    calls.append(1)
    return output * float("inf") if len(calls) >= 5 else output
model.model.layers[0].mlp.register_forward_hook(plant)
data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (32, 16))]
args = TrainingArguments("out", max_steps=8, logging_steps=4, report_to=[], use_cpu=True,
                         save_strategy="no", per_device_train_batch_size=4)
Trainer(model=model, args=args, train_dataset=data).train()
print("script finished")
"""


def normwatch_run(tmp_path: Path, source: str, *flags: str, **env_vars: str
                  ) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "COLUMNS": "120", "NORMWATCH_REPORT_DIR": str(tmp_path / "reports"),
           **env_vars}
    return subprocess.run([str(SCRIPT), "run", *flags, "--", sys.executable, str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def reports(tmp_path: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "reports").glob(
        "*/report.json"))]


@pytest.mark.parametrize("kind", ["plain", "lightning", "transformers"])
def test_a_planted_fault_is_caught_in_an_unmodified_script(tmp_path: Path, kind: str) -> None:
    source = {"plain": PLAIN, "lightning": LIGHTNING, "transformers": HF}[kind]
    result = normwatch_run(tmp_path, source, "--flush-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "script finished" in result.stdout  # the script ran to its end, unchanged
    assert "CRIT nonfinite" in result.stderr  # grouped alarm lines on stderr
    found = reports(tmp_path)
    assert found, result.stderr[-3000:]
    first = found[0]
    assert first["trigger"] in ("nonfinite_activation", "nonfinite_loss", "critical_alarm")
    step = first["first_nonfinite"]["step"]  # type: ignore[index]
    planted = {"plain": 8, "lightning": 6, "transformers": 5}[kind]
    assert step == planted  # steps counted from the optimizer steps
    model = {"plain": "TinyLM", "lightning": "TinyLM", "transformers": "LlamaForCausalLM"}[kind]
    steps = {"plain": 12, "lightning": 10, "transformers": 8}[kind]
    err = result.stderr
    # (anywhere on a line: the HF Trainer's progress bar leaves its line open)
    assert len(re.findall(rf"normwatch: watching {model}: ", err)) == 1, err[-3000:]
    assert re.search(rf"^normwatch: {model}: {steps} steps watched; ", err, re.M), err[-3000:]
    assert re.search(r"^normwatch VERDICT ", err, re.M)  # the verdict, where the user looks
    updates = first["update_history"]  # the script's optimizer was found and watched
    # (Lightning runs the first forward inside the first optimizer.step(closure): the
    # model is found after that step began, its optimizer measured from step 2)
    assert isinstance(updates, list) and updates[0]["step"] == (2 if kind == "lightning"
                                                                  else 1), updates
    assert all(u["update_norm"] != "nan" for u in updates if u["step"] < planted)


def test_a_script_that_dies_leaves_a_post_mortem(tmp_path: Path) -> None:
    source = PLAIN.replace('print("script finished")', 'raise RuntimeError("crashed")') \
        .replace("step >= 8", "False")
    result = normwatch_run(tmp_path, source)
    assert result.returncode == 1 and "RuntimeError: crashed" in result.stderr
    found = reports(tmp_path)
    assert [r["trigger"] for r in found] == ["exception"]


def test_every_normwatch_variable_the_code_reads_is_a_setting_or_an_option() -> None:
    # a variable read somewhere but not named in config.SETTINGS would make `normwatch
    # run` refuse the environment that sets it ('names no option')
    root = Path(__file__).parent.parent
    read = {m for p in (*root.glob("normwatch/**/*.py"), *root.glob("integrations/**/*.py"))
            for m in re.findall(r'"NORMWATCH_([A-Z_]+)"', p.read_text())}
    assert {"RUN", "CACHE", "NATIVE", "LANE"} <= read  # the scan finds what it should
    options = {name.upper() for name in option_defaults()}
    assert read <= set(SETTINGS) | options, read - set(SETTINGS) - options


def test_options_come_from_flags_or_the_environment(tmp_path: Path) -> None:
    assert options_from_env({"NORMWATCH_FLUSH_EVERY": "5", "NORMWATCH_REPORT_DIR": "none",
                              "NORMWATCH_INCLUDE": "a.*,b.*", "NORMWATCH_COUNT_EVAL": "1",
                              "NORMWATCH_FP16_LIMIT": "64", "OTHER": "x",
                              # settings of the process, documented beside the options
                              "NORMWATCH_CACHE": "/tmp/nw", "NORMWATCH_NATIVE": "0",
                              "NORMWATCH_LANE": "0", "NORMWATCH_RUN": "1"}) == {
        "flush_every": 5, "report_dir": None, "include": ("a.*", "b.*"),
        "count_eval": True, "fp16_limit": 64.0}
    tol = options_from_env({"NORMWATCH_OUTPUT_TOL": "0.02"})  # a limit whose default is None
    assert tol == {"output_tol": 0.02}
    assert WatchConfig.from_options(**tol).limits.output_tol == 0.02
    with pytest.raises(ConfigError, match="'NORMWATCH_FLUSH' names no option"):
        options_from_env({"NORMWATCH_FLUSH": "5"})
    bad = normwatch_run(tmp_path, "print('never')", "--console", "lines")
    assert bad.returncode == 0  # a script without models: nothing to watch, runs as usual
    env = {**os.environ, "NORMWATCH_STATS_EVERY": "0"}
    refused = subprocess.run([str(SCRIPT), "run", "--", sys.executable, "-c", "print(1)"],
                             env=env, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "'stats_every' must be an int >= 1" in refused.stderr
    missing = subprocess.run([str(SCRIPT), "run"], capture_output=True, text=True, timeout=60,
                             check=False)
    assert missing.returncode == 2 and "no command" in missing.stderr


CUSTOM_FP16 = """
import torch
from torch import nn

class MyRMSNorm(nn.Module):                        # squares in fp16: overflows past 256
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), MyRMSNorm(16), nn.Linear(16, 4)).half()
seen = []
model[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(1, 9):
    x = torch.randn(8, 16) * (1.0 if step < 4 else 500.0)
    loss = model(x.half()).float().square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
assert len(seen) == 8, seen                        # the user's hook saw only the script's calls
print("script finished")
"""


def test_an_overflowing_custom_norm_is_probed_without_touching_the_script(
        tmp_path: Path) -> None:
    result = normwatch_run(tmp_path, CUSTOM_FP16, "--flush-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "script finished" in result.stdout
    assert "changed size during iteration" not in result.stderr
    assert len(re.findall(r"^normwatch: watching Sequential: ", result.stderr, re.M)) == 1
    found = reports(tmp_path)
    assert found and all(r["trigger"] != "exception" for r in found), result.stderr[-3000:]
    probe = [a for a in found[0]["alarms"] if a["kind"] == "fp16_overflow"]  # type: ignore[union-attr]
    assert probe and any("fp16" in a["message"] for a in probe)


def test_an_unusable_report_dir_is_refused_before_the_script_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = {**os.environ, "NORMWATCH_REPORT_DIR": str(blocker / "reports")}
    refused = subprocess.run([str(SCRIPT), "run", "--", sys.executable, "-c", "print('ran')"],
                             env=env, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "ran" not in refused.stdout
    assert "'report_dir' must be a folder normwatch can create" in refused.stderr


GUARDED = """
import torch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
torch.manual_seed(0)
model = TinyLM(dim=32, depth=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(0)
for step in range(1, 13):
    model.blocks[1].mlp.fault = step == 7          # one poisoned step
    tokens = synthetic_batch(gen, batch=4, seq=16)
    loss = lm_loss(model(tokens), tokens)
    loss.backward(); opt.step(); opt.zero_grad()
print("finite", all(bool(p.isfinite().all()) for p in model.parameters()))
"""


def test_normwatch_guard_keeps_a_poisoned_step_from_an_unmodified_script(
        tmp_path: Path) -> None:
    result = normwatch_run(tmp_path, GUARDED, "--flush-every", "4", NORMWATCH_GUARD="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finite True" in result.stdout  # the NaN step never reached the weights
    assert "The guard skipped 1 optimizer step (step 7)" in result.stderr
    [report] = reports(tmp_path)
    assert report["guard"] == {"skipped_steps": [7], "events": [
        {"step": 7, "reasons": ["a watched norm's input, output or gradient",
                                "the optimizer's gradients"], "skipped": True}]}
    (tmp_path / "off").mkdir()
    unguarded = normwatch_run(tmp_path / "off", GUARDED, "--flush-every", "4")
    assert "finite False" in unguarded.stdout  # without it, the step poisons the weights


CLIPPED = """
import torch
from torch.nn.utils import clip_grad_norm_  # bound at import, before any watch exists
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
torch.manual_seed(0)
model = TinyLM(dim=64, depth=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(0)
for step in range(1, 9):
    model.blocks[1].mlp.fault = step == 7
    tokens = synthetic_batch(gen, batch=4, seq=16)
    lm_loss(model(tokens), tokens).backward()
    print("norm", step, float(clip_grad_norm_(model.parameters(), 1e9)))
    opt.step(); opt.zero_grad()
print("finite", all(bool(p.isfinite().all()) for p in model.parameters()))
"""


def test_under_normwatch_run_the_scripts_own_clip_norm_is_the_reported_one(
        tmp_path: Path) -> None:
    """``clip_grad_norm_`` imported by name at the top of the script: ``normwatch run``
    wrapped it before the script started, so the guard and the update monitor take the
    norm it computed (exact; the monitor's own sample of these 16k-element weights is an
    estimate) and the poisoned step is still skipped."""
    result = normwatch_run(tmp_path, CLIPPED, "--flush-every", "4", NORMWATCH_GUARD="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finite True" in result.stdout
    printed = {int(s): float(v) for _, s, v in (line.split() for line in
                                                 result.stdout.splitlines()
                                                 if line.startswith("norm "))}
    [report] = reports(tmp_path)
    assert report["guard"]["skipped_steps"] == [7]  # type: ignore[index]
    history = {u["step"]: u["grad_norm"] for u in report["update_history"]}  # type: ignore[attr-defined]
    watched = [s for s in history if s != 1 and isinstance(history[s], float)]
    assert watched and all(history[s] == pytest.approx(printed[s], rel=1e-6) for s in watched)


@contextmanager
def auto_watch() -> Iterator[Any]:
    """``normwatch run``'s session (``AutoWatch``) in this process, installed: no console,
    no reports, no flush before the test's own; finished after."""
    from integrations.script import AutoWatch

    session = AutoWatch(WatchConfig(console=None, report_dir=None, flush_every=100))
    session.install()
    try:
        yield session
    finally:
        session.finish()


def test_each_model_of_a_gan_steps_with_its_own_optimizer_and_loss() -> None:
    """A GAN under ``normwatch run``: two models, each with its optimizer, stepping in
    turn, the discriminator called again for the generator's loss. Each watch counts its
    model's steps, with its own loss and its own optimizer's gradient norms (before, every
    optimizer step stepped both watches, and each measured both optimizers)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    gen_model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                              nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.LeakyReLU(0.2),
                         nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen_model.parameters(), lr=2e-4)
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()
    seen: dict[str, list[tuple[float, float]]] = {"g": [], "d": []}

    def grad_norm(model: nn.Module) -> float:
        return float(torch.linalg.vector_norm(torch.cat(
            [p.grad.double().flatten() for p in model.parameters() if p.grad is not None])))

    with auto_watch() as session:
        for _ in range(6):
            real, fake = torch.randn(16, 16) + 2, gen_model(torch.randn(16, 8))
            loss_d = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()),
                                                              torch.zeros(16, 1))
            opt_d.zero_grad()
            loss_d.backward()
            seen["d"].append((float(loss_d.detach()), grad_norm(disc)))
            opt_d.step()
            loss_g = bce(disc(fake), torch.ones(16, 1))
            opt_g.zero_grad()
            loss_g.backward()
            seen["g"].append((float(loss_g.detach()), grad_norm(gen_model)))
            opt_g.step()
        snaps = {name: session.watches[id(model)].flush()
                 for name, model in (("g", gen_model), ("d", disc))}
    for name, snap in snaps.items():
        assert snap is not None and snap.step == 6, name
        assert [loss for _, loss in snap.losses] == [loss for loss, _ in seen[name]], name
        assert len(snap.updates) == 6, name
        assert [u.grad_norm for u in snap.updates] == pytest.approx(
            [norm for _, norm in seen[name]], rel=1e-5), name


@pytest.mark.parametrize("case", ["actor-critic", "an input optimized"])
def test_an_optimizer_that_trains_no_watched_model(case: str) -> None:
    """An actor-critic whose critic has no norm, its optimizer stepping first: the
    actor's watch steps with the actor's optimizer and loss only. A frozen model through
    which an input is optimized: its watch steps with that input's optimizer."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 2))
    critic = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    frozen = case == "an input optimized"
    wanted = torch.zeros(8, 4, requires_grad=True)
    if frozen:
        actor.requires_grad_(False)
    optimizers = [torch.optim.Adam([wanted] if frozen else critic.parameters(), lr=1e-2),
                  torch.optim.Adam(actor.parameters(), lr=1e-2)]
    losses = []
    with auto_watch() as session:
        for _ in range(5):
            states = wanted if frozen else torch.randn(8, 4)
            actions, values = actor(states), critic(states)
            first = (actions - 1).pow(2).mean() if frozen else values.pow(2).mean()
            optimizers[0].zero_grad()
            first.backward(retain_graph=True)
            optimizers[0].step()
            losses.append(float(first.detach()))
            if not frozen:
                second = -(actions.sum(-1) * values.detach().squeeze(-1)).mean()
                optimizers[1].zero_grad()
                second.backward()
                optimizers[1].step()
                losses[-1] = float(second.detach())
        snap = session.watches[id(actor)].flush()
    assert snap is not None and snap.step == 5
    assert [loss for _, loss in snap.losses] == losses
    assert len(snap.updates) == 5
