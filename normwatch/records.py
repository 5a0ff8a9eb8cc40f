"""Plain records shared by every stage: alarms, verdicts, layers, snapshots, limits.

A leaf module: it imports nothing of normwatch's and no torch, so the pure stages
(:mod:`normwatch.judge`, :mod:`normwatch.report`) and their tests can build these by hand.
The vocabularies (alarm kinds, severities, blames, triggers, norm kinds) are declared
here once; everything that lists them (Prometheus label values, the HTML legend, the
dashboards' tests) reads them from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

# -- vocabularies ---------------------------------------------------------------------------

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}

AlarmKind = Literal[
    "fp16_overflow", "fp16_headroom", "nonfinite", "eps_dominance", "common_mode",
    "dtype_mismatch", "output_mismatch", "gradient_nonfinite", "gradient_decay",
    "gradient_headroom", "guard_skipped", "guard_exhausted",
]  # fmt: skip
ALARM_KINDS: tuple[AlarmKind, ...] = get_args(AlarmKind)

Kind = Literal["layernorm", "rmsnorm", "groupnorm", "batchnorm", "instancenorm"]
KINDS: tuple[Kind, ...] = get_args(Kind)
WeightForm = Literal["w", "1+w"]

Trigger = Literal["loss_spike", "nonfinite_loss", "nonfinite_activation", "critical_alarm",
                  "exception"]
TRIGGERS: tuple[Trigger, ...] = get_args(Trigger)
Blame = Literal["normalization", "not_normalization", "inconclusive"]
BLAMES: tuple[Blame, ...] = get_args(Blame)

# -- limits ---------------------------------------------------------------------------------

FP16_MAX = 65504.0
"""The largest finite fp16 value."""


@dataclass(frozen=True)
class Limits:
    """The thresholds measurements are judged against; they travel with the data (the
    fold, the rules, logger metrics, Prometheus, ``report.json``)."""

    fp16_limit: float = 256.0
    """|x| above this overflows x² in fp16 (256² = 65536 > 65504)."""
    eps_tol: float = 0.01
    """A token is eps-dominated when eps/(s + eps) exceeds this."""
    common_mode_tol: float = 0.9
    """A token has a common mode when |mean|/RMS exceeds this."""
    common_mode_fraction: float = 0.1
    """``common_mode`` fires when more than this fraction of tokens has one."""
    output_tol: float | None = None
    """Relative error that counts as an output mismatch (``None``: from the output dtype)."""

    def headroom(self, absmax: float | None) -> float | None:
        """``fp16_limit / max |x|`` (below 1: overflow), ``None`` without a positive max."""
        return self.fp16_limit / absmax if absmax else None


# -- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayPoint:
    """What a user needs to re-run one step."""

    step: int
    fingerprint: str | None
    """``dtype[shape]:hash`` of each integer input of the step's batch or first forward (see
    :mod:`normwatch.measure.step.replay`); ``None``: it had none, or the model is compiled."""
    position: dict[str, int | float | str]
    """What the framework knew of the data position (Lightning: ``epoch``, ``batch_idx``;
    Hugging Face: ``global_step``, ``epoch``); empty in plain loops."""
    rng: dict[str, str]
    """``torch_initial_seed`` and the RNG states the step started from, base64
    (``torch.set_rng_state(torch.frombuffer(base64.b64decode(s), dtype=torch.uint8))``)."""


@dataclass(frozen=True)
class GuardEvent:
    """One poisoned optimizer step (``guard=True``)."""

    step: int
    reasons: tuple[str, ...]
    """What held NaN/inf: a watched norm's input, output or gradient; the optimizer's
    gradients."""
    skipped: bool
    """``False``: the guard's bound was reached and the step was applied."""


@dataclass(frozen=True)
class Alarm:
    """One finding. ``message`` says what it means and what to do."""

    kind: AlarmKind
    severity: Severity
    layer: str | None
    step: int
    value: float
    threshold: float
    message: str
    count: int = 1
    """How many occurrences this alarm stands for (see de-duplication)."""
    tag: str = field(default="", compare=False)
    """Distinguishes alarms of one kind and layer that must not be merged."""


@dataclass(frozen=True)
class Verdict:
    """What triggered, whether normalization is to blame, and why."""

    trigger: Trigger
    step: int
    blame: Blame
    layer: str | None
    cause: str | None
    """An alarm kind (``fp16_overflow``, ``eps_dominance``, ``output_mismatch``,
    ``nonfinite``) or ``stat_jump`` when a norm is blamed; ``optimizer`` (the update
    before the trigger jumped) or ``data`` (normal updates, healthy norms, a jump only
    in the loss) when not; ``None`` when nothing measured explains it."""
    evidence: tuple[str, ...]
    block: str | None = None
    """When a non-finite value arrived from upstream: the code between the last healthy
    norm and the first sick one."""


MEASURED_EPS_FLOOR = 1e-15
"""A measured eps below this was written 0 (the measurement resolves ~1e-20 absolute)."""


def as_written(value: float, rel: float = 1e-9) -> float:
    """The shortest decimal within ``rel`` of ``value`` (a measurement's last digits are
    its arithmetic, not the number it measured).

    >>> as_written(1.0000000000000011e-05), as_written(0.00014999999999999993)
    (1e-05, 0.00015)
    """
    if not math.isfinite(value) or value == 0:
        return value
    for digits in range(1, 17):
        short = float(f"{value:.{digits}g}")
        if abs(short - value) <= rel * abs(value):
            return short
    return value


@dataclass(frozen=True)
class NormLayer:
    """One normalization layer found in a model.

    ``normalized_shape`` is the shape of one token: the trailing dims for layer and
    RMS norms, ``(channels,)`` for group, batch and instance norms.
    """

    name: str
    kind: Kind
    eps: float
    normalized_shape: tuple[int, ...] | None
    weight_form: WeightForm
    class_name: str
    num_groups: int | None = None
    builtin: bool = False
    """One of torch's own norm modules (its dtypes under autocast are autocast's rules)."""
    eps_measured: bool = False
    """``eps`` was measured from the module's output (it has no eps attribute: a literal
    in its forward), not read."""

    @property
    def eps_written(self) -> float:
        """``eps`` as the code wrote it: a measured 1.0000000000000011e-05 reads 1e-05
        (:func:`as_written`); a read eps as it is."""
        if not self.eps_measured:
            return self.eps
        return 0.0 if self.eps < MEASURED_EPS_FLOOR else as_written(self.eps)

    @property
    def token_size(self) -> int | None:
        """Elements per token for layer/RMS norms (``None`` where it depends on the input)."""
        if self.kind in ("layernorm", "rmsnorm") and self.normalized_shape is not None:
            return math.prod(self.normalized_shape)
        return None


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of probing one layer's fp16 safety in one dtype; ``None`` fields: unknown."""

    dtype: str
    element_safe: bool | None
    sum_safe: bool | None
    detail: str = ""

    @property
    def safe(self) -> bool | None:
        """Safe against both probes (``None`` if either is unknown)."""
        if self.element_safe is None or self.sum_safe is None:
            return None
        return self.element_safe and self.sum_safe


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one norm layer, aggregated since the previous flush.

    The numeric fields are the public statistics of :mod:`normwatch.catalog` (where each
    is declared, with how it combines and is derived). Value statistics cover the finite
    tokens; they are ``None`` when the layer saw none in the interval. ``rms_*`` are over
    per-token ``sqrt(mean(x²))``.
    """

    name: str
    kind: Kind
    calls: int
    tokens: int
    finite_tokens: int
    stats_tokens: int
    """Finite tokens measured with the full statistics (the rest: sentinel tier only)."""
    absmax: float | None
    fp16_overflow_tokens: int
    sumsq_max: float | None
    rms_min: float | None
    rms_mean: float | None
    rms_max: float | None
    eps_dominance: float | None
    eps_dominated_tokens: int
    common_mode_max: float | None
    common_mode_tokens: int
    nonfinite: int
    """Input tokens holding at least one NaN/inf."""
    out_nonfinite: int
    """Output tokens holding at least one NaN/inf."""
    out_absmax: float | None
    output_mismatch: float | None
    output_eps: float | None
    """The precision the checked outputs carry: eps of the coarsest format (bf16, fp16,
    else their dtype) holding every value exactly; ``None`` when not checked."""
    input_dtype: str | None = None
    weight_dtype: str | None = None
    output_dtype: str | None = None
    autocast: str | None = None
    """``"<device>:<dtype>"`` when the last call ran under autocast, else ``None``."""
    autocast_made: bool | None = None
    """Under autocast, an fp32 output from a lower-precision input: whether the op that
    made it is one autocast runs in fp32 (``None``: not such an output, or unknown)."""
    # gradients through the norm (full-tier steps; None: no backward measured)
    grad_out_absmax: float | None = None
    grad_out_rms: float | None = None
    """RMS of dL/dy, the gradient arriving at the output."""
    grad_out_nonfinite: int = 0
    grad_in_absmax: float | None = None
    grad_in_rms: float | None = None
    """RMS of dL/dx through the norm only (the gradient it passes back)."""
    grad_in_nonfinite: int = 0
    grad_hidden_absmax: float | None = None
    grad_hidden_rms: float | None = None
    """RMS of dL/dx in total: the hidden state's gradient where the norm reads it."""
    grad_hidden_nonfinite: int = 0
    grad_gain: float | None = None
    """``grad_in_rms / grad_out_rms``."""
    weight_grad_norm: float | None = None
    """The norm of the weight's gradient, RMS over backward passes (local, per rank)."""

    @property
    def seen(self) -> bool:
        """Whether the layer was called (and counted) in the interval."""
        return self.calls > 0

    @property
    def fp16(self) -> bool:
        """The layer's input is fp16, or it ran under fp16 autocast."""
        return self.input_dtype == "float16" or (self.autocast or "").split(":")[-1] == "float16"


@dataclass(frozen=True)
class FirstNonfinite:
    """Where the first non-finite value of an interval showed up."""

    step: int
    layer: str
    position: int
    """The layer's index in forward order (0 = first norm the input meets)."""
    origin: Literal["input", "norm"]
    """``"input"``: it arrived in the norm's input; ``"norm"``: born inside the norm."""


@dataclass(frozen=True)
class UpdateStats:
    """One optimizer step seen from its step hooks: the gradient it received and the
    update it made (local to this rank: a shard under FSDP2)."""

    step: int
    grad_norm: float
    """The global L2 norm of the gradients the optimizer received (after any clipping)."""
    update_norm: float
    """The L2 norm of the parameter change the step made."""
    param_norm: float
    """The L2 norm of the parameters after the step (measured on full-tier steps, the
    last measured one on the steps between: it moves slowly)."""
    lr: float | None
    """The largest learning rate of the optimizers' groups (``None`` when not a number)."""

    @property
    def update_ratio(self) -> float | None:
        """``update_norm / param_norm``: the relative size of the step."""
        return self.update_norm / self.param_norm if self.param_norm > 0 else None


@dataclass(frozen=True)
class Snapshot:
    """Everything one flush copied to the host."""

    step: int
    """The optimizer step the interval ended at (steps counted by ``watch.step``)."""
    first_step: int
    """The first step of the interval."""
    layers: Mapping[str, LayerStats]
    first_nonfinite: FirstNonfinite | None = None
    losses: tuple[tuple[int, float], ...] = field(default=())
    """``(step, loss)`` for each ``watch.step(loss)`` of the interval."""
    updates: tuple[UpdateStats, ...] = field(default=())
    """One per optimizer step of the interval (optimizers given to ``watch_optimizer``)."""
    loss_scale: float | None = None
    """The loss scaler's scale at the flush (``watch_scaler``); gradient statistics are
    divided by it."""
