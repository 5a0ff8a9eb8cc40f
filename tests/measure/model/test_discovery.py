"""Discovery: every norm of torch, transformers and custom code, with exact names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normwatch
from normwatch.measure.model.discovery import clean_name, describe
from tests.conftest import tiny_hf


def names(model: nn.Module, **kw: object) -> list[str]:
    return [layer.name for layer in normwatch.find_norm_layers(model, **kw)]  # type: ignore[arg-type]


def _decoder(prefix: str, n: int, extra: tuple[str, ...] = ()) -> list[str]:
    out = []
    for i in range(n):
        out += [f"{prefix}.layers.{i}.self_attn.{e}" for e in extra]
        out += [f"{prefix}.layers.{i}.input_layernorm",
                f"{prefix}.layers.{i}.post_attention_layernorm"]
    return [*out, f"{prefix}.norm"]


EXPECTED = {
    "llama": _decoder("model", 2),
    "qwen3": _decoder("model", 2, ("q_norm", "k_norm")),
    "gemma": _decoder("model", 2),
    "gpt2": ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1",
             "transformer.h.1.ln_2", "transformer.ln_f"],
    "t5": ["encoder.block.0.layer.0.layer_norm", "encoder.block.0.layer.1.layer_norm",
           "encoder.block.1.layer.0.layer_norm", "encoder.block.1.layer.1.layer_norm",
           "encoder.final_layer_norm", "decoder.block.0.layer.0.layer_norm",
           "decoder.block.0.layer.1.layer_norm", "decoder.block.0.layer.2.layer_norm",
           "decoder.final_layer_norm"],
    "bert": ["bert.embeddings.LayerNorm", "bert.encoder.layer.0.attention.output.LayerNorm",
             "bert.encoder.layer.0.output.LayerNorm",
             "bert.encoder.layer.1.attention.output.LayerNorm",
             "bert.encoder.layer.1.output.LayerNorm", "cls.predictions.transform.LayerNorm"],
}
KINDS = {"llama": "rmsnorm", "qwen3": "rmsnorm", "gemma": "rmsnorm", "gpt2": "layernorm",
         "t5": "rmsnorm", "bert": "layernorm"}
EPS = {"llama": 1e-6, "qwen3": 1e-6, "gemma": 1e-6, "gpt2": 1e-5, "t5": 1e-6, "bert": 1e-12}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_transformers_models_exact_layer_list(arch: str) -> None:
    layers = normwatch.find_norm_layers(tiny_hf(arch))
    assert [layer.name for layer in layers] == EXPECTED[arch]
    assert {layer.kind for layer in layers} == {KINDS[arch]}
    assert {layer.eps for layer in layers} == {EPS[arch]}
    assert {layer.weight_form for layer in layers} == {"1+w" if arch == "gemma" else "w"}


def test_qwen3_head_dim_norms_have_head_dim_shape() -> None:
    layers = {x.name: x for x in normwatch.find_norm_layers(tiny_hf("qwen3"))}
    assert layers["model.layers.0.self_attn.q_norm"].normalized_shape == (8,)
    assert layers["model.layers.0.input_layernorm"].normalized_shape == (32,)


def test_torch_families() -> None:
    model = nn.Sequential(
        nn.LayerNorm((4, 8), eps=1e-3), nn.RMSNorm(8), nn.GroupNorm(2, 6, eps=1e-4),
        nn.BatchNorm1d(6), nn.BatchNorm2d(3), nn.InstanceNorm2d(3), nn.Linear(3, 3),
        nn.SyncBatchNorm(3),
    )
    got = [(x.name, x.kind, x.normalized_shape, x.num_groups) for x in
           normwatch.find_norm_layers(model)]
    assert got == [
        ("0", "layernorm", (4, 8), None), ("1", "rmsnorm", (8,), None),
        ("2", "groupnorm", (6,), 2), ("3", "batchnorm", (6,), None),
        ("4", "batchnorm", (3,), None), ("5", "instancenorm", (3,), None),
        ("7", "batchnorm", (3,), None),
    ]
    assert normwatch.find_norm_layers(model)[0].eps == 1e-3


class MyCustomRMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.variance_epsilon = 1e-5


class ScaleNorm(nn.Module):  # ends in Norm, but no eps: not a norm we can reason about
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))


class Normalizer(nn.Module):  # custom name, registered explicitly
    def __init__(self) -> None:
        super().__init__()
        self.epsilon = 1e-4
        self.gain = nn.Parameter(torch.ones(8))


class WrapperNorm(nn.Module):  # a matched norm's children are not searched
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.bias = nn.Parameter(torch.zeros(8))
        self.eps = 1e-5
        self.inner = nn.LayerNorm(8)


def test_duck_typing_and_registration() -> None:
    model = nn.ModuleDict({"a": MyCustomRMSNorm(), "b": ScaleNorm(), "c": Normalizer(),
                           "d": WrapperNorm()})
    got = {x.name: (x.kind, x.eps) for x in normwatch.find_norm_layers(model)}
    assert got == {"a": ("rmsnorm", 1e-5), "d": ("layernorm", 1e-5)}
    normwatch.register_norm(Normalizer, kind="rmsnorm", eps_attr="epsilon")
    try:
        got = {x.name: (x.kind, x.eps) for x in normwatch.find_norm_layers(model)}
        assert got == {"a": ("rmsnorm", 1e-5), "c": ("rmsnorm", 1e-4), "d": ("layernorm", 1e-5)}
    finally:
        normwatch.unregister_norm(Normalizer)


def test_register_norm_rejects_bad_arguments() -> None:
    with pytest.raises(normwatch.ConfigError, match=r"'kind' must be one of .* got 'l2norm'"):
        normwatch.register_norm(Normalizer, kind="l2norm")  # type: ignore[arg-type]
    with pytest.raises(normwatch.ConfigError, match=r"'cls' must be a torch\.nn\.Module"):
        normwatch.register_norm(int, kind="rmsnorm")  # type: ignore[arg-type]


def test_include_exclude_patterns() -> None:
    model = tiny_hf("llama")
    assert names(model, include=["*.norm"]) == ["model.norm"]
    assert names(model, exclude=["*post_attention*", "model.norm"]) == [
        "model.layers.0.input_layernorm", "model.layers.1.input_layernorm"]


class DDPLike(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_wrapper_prefixes_are_stripped() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = tiny_hf("llama")
    inner.model.layers[0] = checkpoint_wrapper(inner.model.layers[0])
    wrapped = DDPLike(torch.compile(inner))
    assert names(wrapped) == EXPECTED["llama"]
    assert clean_name("module._orig_mod.a._fsdp_wrapped_module.b") == "a.b"
    assert clean_name("a.module.b") == "a.module.b"  # only a leading DDP 'module' is a wrapper


def test_shared_module_listed_once_and_not_model() -> None:
    norm = nn.LayerNorm(4)
    model = nn.Sequential(norm, nn.Linear(4, 4), norm)
    assert names(model) == ["0"]
    with pytest.raises(normwatch.ConfigError,
                       match=r"'model' must be a torch\.nn\.Module: got list"):
        normwatch.find_norm_layers([norm])  # type: ignore[arg-type]


def test_meta_device_model_is_discovered() -> None:
    with torch.device("meta"):
        model = tiny_hf("llama")
    assert names(model) == EXPECTED["llama"]
    assert copy.deepcopy(model) is not None


def healthy_step(model: nn.Module) -> normwatch.Watch:
    """One training step on token ids that avoid the special (padding) ids."""
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    w.step(loss)
    return w


def test_cohere_layer_norms_are_classified_by_behaviour_with_per_head_tokens() -> None:
    import transformers as t

    model = t.CohereForCausalLM(t.CohereConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))
    layers = {layer.name: layer for layer in normwatch.find_norm_layers(model)}
    # mean-subtracting without a bias: LayerNorm, not RMSNorm; q/k norms per head (8)
    q = layers["model.layers.0.self_attn.q_norm"]
    assert (q.kind, q.normalized_shape, q.token_size) == ("layernorm", (8,), 8)
    assert layers["model.layers.0.input_layernorm"].kind == "layernorm"
    w = healthy_step(model)
    snap = w.last_snapshot
    assert snap is not None
    assert all(s.output_mismatch is not None and s.output_mismatch < 1e-5
               for s in snap.layers.values())  # the output check agrees with the formula
    assert snap.layers["model.layers.0.self_attn.q_norm"].tokens == 2 * 16 * 4
    assert [a for a in w.alarms if a.severity != "info"] == []


def test_mamba2_gated_norm_is_discovered_with_group_tokens() -> None:
    import transformers as t

    model = t.Mamba2ForCausalLM(t.Mamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
        n_groups=2, state_size=8, expand=2, initializer_range=0.1))
    layers = {layer.name: layer for layer in normwatch.find_norm_layers(model)}
    gated = layers["backbone.layers.0.mixer.norm"]  # 64 channels in 2 groups of 32
    name = type(model.backbone.layers[0].mixer.norm).__name__  # (renamed in transformers 5.25)
    assert name.endswith("RMSNormGated")
    assert (gated.kind, gated.class_name, gated.token_size) == ("rmsnorm", name, 32)
    w = healthy_step(model)
    snap = w.last_snapshot
    assert snap is not None
    # a gate is an extra input: no formula of x alone to check the output against
    assert snap.layers["backbone.layers.0.mixer.norm"].output_mismatch is None
    assert snap.layers["backbone.layers.0.norm"].output_mismatch is not None
    assert snap.layers["backbone.layers.0.mixer.norm"].tokens == 2 * 16 * 2
    assert [a for a in w.alarms if a.severity != "info"] == []


def test_a_norm_named_module_that_is_not_a_norm_is_left_alone() -> None:
    class NormalizedProjection(nn.Module):  # "Norm" in the name, a weight and an eps
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))
            self.eps = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    assert normwatch.find_norm_layers(nn.Sequential(NormalizedProjection())) == []


def test_stablelm_per_head_norms_are_one_layer_with_per_head_weights() -> None:
    import transformers as t

    model = t.StableLmForCausalLM(t.StableLmConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, qk_layernorm=True))
    layers = {layer.name: layer for layer in normwatch.find_norm_layers(model)}
    q = layers["model.layers.0.self_attn.q_layernorm"]
    assert (q.kind, q.class_name, q.token_size) == ("layernorm", "StableLmLayerNormPerHead", 8)
    assert not [n for n in layers if ".norms." in n]  # the heads are not listed one by one
    with torch.no_grad():  # heads that differ, as after training
        for head in model.model.layers[0].self_attn.q_layernorm.norms:
            head.weight.uniform_(0.5, 1.5)
    w = healthy_step(model)
    snap = w.last_snapshot
    assert snap is not None
    stats = snap.layers["model.layers.0.self_attn.q_layernorm"]
    assert stats.tokens == 2 * 16 * 4  # batch x seq x heads
    assert stats.output_mismatch is not None and stats.output_mismatch < 1e-5
    assert [a for a in w.alarms if a.severity != "info"] == []


class SplitHeadsNorm(nn.Module):
    """xLSTM's multi-head LayerNorm: (B, S, heads, width) in, each head normalized, heads
    flattened out, one flat weight over all heads; ``over_heads`` normalizes the whole
    row instead (a wrong reduction dimension)."""

    def __init__(self, num_heads: int = 4, head_dim: int = 8, over_heads: bool = False
                 ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, 1e-6
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, num_heads * head_dim))
        self.over_heads = over_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h, d = x.shape
        t = x.reshape(b, s, 1, h * d) if self.over_heads else x
        t = (t - t.mean(-1, keepdim=True)) * torch.rsqrt(
            t.var(-1, keepdim=True, unbiased=False) + self.eps)
        return t.reshape(b, s, h * d) * self.weight


def test_a_norm_over_split_heads_has_one_token_per_head() -> None:
    layer = describe(SplitHeadsNorm(), "norm")
    assert layer is not None and (layer.kind, layer.normalized_shape) == ("layernorm", (8,))
    model = SplitHeadsNorm()
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    x = torch.randn(2, 5, 4, 8, dtype=torch.float64).float() * torch.tensor([1.0, 3, 10, 30]
                                                                           ).reshape(4, 1)
    model(x)
    w.step()
    stats = w.last_snapshot.layers[""]  # type: ignore[union-attr]
    rms = x.double().pow(2).mean(-1).sqrt()  # float64 reference, per head
    assert stats.tokens == 2 * 5 * 4
    assert stats.rms_max == pytest.approx(float(rms.max()), rel=1e-5)
    assert stats.rms_min == pytest.approx(float(rms.min()), rel=1e-5)
    assert stats.output_mismatch is not None and stats.output_mismatch < 1e-5
    # a norm that reduces over all heads is told apart by its output
    wrong = SplitHeadsNorm(over_heads=True)
    assert describe(wrong, "norm") is not None
    assert describe(wrong, "norm").normalized_shape == (4, 8)  # type: ignore[union-attr]


def test_a_subclass_of_torch_norm_with_its_own_forward_is_classified_by_behaviour() -> None:
    """Nemotron's LayerNorm1P subclasses nn.LayerNorm and scales by 1 + w."""
    import torch.nn.functional as F

    class LayerNorm1P(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)

    norm = LayerNorm1P(16)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    layer = describe(norm, "n")
    assert layer is not None and (layer.kind, layer.weight_form) == ("layernorm", "1+w")
    plain = describe(nn.LayerNorm(16), "p")
    assert plain is not None and plain.weight_form == "w" and plain.builtin


class LiteralEpsLayerNorm(nn.Module):
    """LayerNorm with eps written into forward (no eps attribute), as GPT scripts do."""

    def __init__(self, d: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.randn(d)) if bias else None
        self.literal = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias,
                                              self.literal)


class LiteralEpsRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.literal = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.literal)


@pytest.mark.parametrize("eps", [0.0, 1e-8, 1e-6, 1e-5, 1e-3])
@pytest.mark.parametrize("width", [32, 33])
def test_an_eps_given_as_a_literal_is_measured_from_the_output(eps: float, width: int) -> None:
    for module in (LiteralEpsLayerNorm(width, eps, True), LiteralEpsLayerNorm(width, eps, False),
                   LiteralEpsRMSNorm(width, eps)):
        (layer,) = normwatch.find_norm_layers(nn.Sequential(module))
        assert layer.eps_measured and layer.eps == pytest.approx(eps, rel=1e-3, abs=1e-12)
        assert layer.eps_written == eps  # as the code wrote it, to the last digit
    (read,) = normwatch.find_norm_layers(nn.Sequential(nn.LayerNorm(width, eps=eps)))
    assert not read.eps_measured and read.eps == eps
