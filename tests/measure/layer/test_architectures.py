"""Every ``transformers`` causal-LM family: its norms found, classified by what they compute
(the first flush checks every output against its kind's formula), quiet on a healthy step.

Tiny random configs (no downloads): each family's default config with the usual size
fields shrunk. A family whose config cannot be shrunk this way, or that will not run on
the CPU, is skipped with the reason (``pytest -rs`` lists them).
"""

from __future__ import annotations

import fnmatch
import logging
import warnings

import pytest
import torch

import normwatch

pytest.importorskip("transformers")
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from tests.zoo import batch, inputs, tiny

PROJECTIONS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
# Modules named "*Norm*" that compute neither formula: deliberately not watched.
NOT_WATCHED = {
    "dory": ("DoryL2Norm", "projects onto the unit sphere: x / ||x||, not x / RMS(x)"),
    "zaya": ("ZayaQKNorm", "normalizes q and k together in one call (two inputs, two outputs)"),
    "phi4_multimodal": ("Phi4MultimodalAudioMeanVarianceNormLayer",
                        "a fixed standardisation by stored statistics, not a per-token norm"),
    "hy_v4": ("HYV4UnweightedRMSNorm", "returns only the scale 1/sqrt(mean(x^2) + eps) "
              "(shape [..., 1]) that its caller multiplies by, not a normalized x"),
}
# True findings of a tiny random init (per-token RMS measured ~1e-4 against eps 1e-6..1e-5):
# eps dominates these norms' inputs at step 1.
AT_INIT = {
    "rwkv": "*.pre_ln",  # RWKV initialises its embeddings at +-1e-4 by design
    "bailing_hybrid": "*.o_norm",  # gated linear-attention outputs at init
    "kimi_linear": "*.o_norm",
    "olmo_hybrid": "*.o_norm",
    "lara_mini": "*.linear_attn.norm",
    "qwen3_next": "*.linear_attn.norm",
    "qwen3_5": "*.linear_attn.norm",
    "qwen3_5_moe": "*.linear_attn.norm",
    "qwen4_exp": "*.linear_attn.norm",
    "qwen3_5_text": "*.linear_attn.norm",
    "qwen3_5_moe_text": "*.linear_attn.norm",
    "qwen4_exp_text": "*.linear_attn.norm",
    "gemma3n_text": "*.post_per_layer_input_norm",  # its input is exactly 0 at init
    "xlstm": "*.mlstm_layer.multihead_norm",  # mLSTM cell outputs: per-head variance <1e-7
    "blt": "*.cross_attn_layers.*.q_norm",  # the queries of empty patches are exactly 0
}



def step(model_type: str, model: torch.nn.Module, w: normwatch.Watch) -> None:
    try:
        loss = model(**inputs(model_type, model.config, batch()), use_cache=False).loss
        loss.backward()
    except Exception as exc:
        w.close()
        pytest.skip(f"{model_type}: does not train on the CPU at this size: "
                    f"{type(exc).__name__}: "
                    f"{str(exc)[:120]}")
    w.step(loss)


@pytest.mark.parametrize(("model_type", "class_name"),
                         sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))
def test_family(model_type: str, class_name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            model = tiny(model_type, class_name)
            w = normwatch.watch(model, flush_every=1, report_dir=None, report_console=False)
            step(model_type, model, w)
        finally:
            logging.disable(logging.NOTSET)
    found = [layer.name for layer in w.layers]
    skipped_class = NOT_WATCHED.get(model_type, ("", ""))[0]
    # modules named "*Norm*" that hold no projection (not "RobertaPreLayerNormOutput")
    normlike = [name for name, m in model.named_modules()
                if "norm" in type(m).__name__.lower() and name
                and type(m).__name__ != skipped_class
                and not any(isinstance(c, PROJECTIONS) for c in m.modules())]
    covered = [n for n in normlike
               if any(n == f or n.startswith(f + ".") or f.startswith(n + ".") for f in found)]
    assert covered == normlike, "not discovered: " + ", ".join(sorted(set(normlike) -
                                                                    set(covered)))
    snap = w.last_snapshot
    assert snap is not None and (not found or any(s.seen for s in snap.layers.values()))
    at_init = AT_INIT.get(model_type)
    loud = [(a.kind, a.severity, a.layer) for a in w.alarms if a.severity != "info"
            and not (at_init and a.kind == "eps_dominance"
                     and fnmatch.fnmatchcase(a.layer or "", at_init))]
    assert loud == []
    w.close()
