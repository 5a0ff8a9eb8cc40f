"""The native lanes' contract (normwatch.measure.backends.native.contract): every name it
hands the C++ is an attribute of the object its role says, on a real watch; the records
the lanes fill are laid out as it says; no attribute name is written in the C++."""

from __future__ import annotations

import re

import pytest
import torch

import normwatch
from normwatch.measure.backends.native import build, contract, lane
from normwatch.measure.backends.native.sampler import NativePack
from normwatch.measure.state.rows import HIDDEN, IN, OUT, SITES, WEIGHT, CallRows, GradRows
from tests.benchmarks.overhead import tiny_llama, train_step

OWNERS = {  # role -> which object's attribute it names
    **dict.fromkeys(("paused", "full_stats", "check_outputs", "gradients", "step",
                     "calls_this_step", "accumulator"), "runtime"),
    **dict.fromkeys(("calls", "tokens", "input_shape", "output_checked"), "counts"),
    **dict.fromkeys(("training", "weight"), "module"),
    **dict.fromkeys(("staged_calls", "staged_grads", "staged_tokens", "max_staged", "commit"),
                    "accumulator"),
    **dict.fromkeys(("free", "lent", "take"), "lender"),
    **dict.fromkeys(("lane_state", "tail", "fail", "recorder"), "hook"),
    "capsule": "lane state",
    **dict.fromkeys(("python_call", "python_grad"), "compiled path"),
    **dict.fromkeys(("grads", "module", "signature", "record_dtypes", "after"), "recorder"),
    **dict.fromkeys(("computed", "hooked_weight", "grad_lane", "node", "both", "weight_grad",
                     "through", "gather"), "gradient hooks"),
    **{role: "pack" for role in contract.NAMES if role.startswith("pack_")},
}


def test_every_name_of_the_contract_is_an_attribute_of_its_object() -> None:
    if build.library() is None:
        pytest.skip("no C library: no native sample to look at")
    torch.manual_seed(0)
    model = tiny_llama(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None, stats_every=1)
    train_step(model, opt, torch.randint(0, 1024, (2, 8)), w)
    hook = w._measure._hooks[0]
    recorder = hook.recorder
    (_, pack), *_ = w._updates._sampled[id(opt)].packs
    assert isinstance(pack, NativePack)
    objects = {"runtime": recorder.rt, "counts": recorder.counts, "module": hook.module,
               "accumulator": recorder.rt.accumulator, "lender": recorder.rt.accumulator.buffers,
               "hook": hook, "compiled path": hook.compiled, "lane state": lane.State(None),
               "recorder": recorder,
               "gradient hooks": recorder.grads, "pack": pack}
    assert OWNERS.keys() == contract.NAMES.keys()
    missing = [(role, name) for role, name in contract.NAMES.items()
               if not hasattr(objects[OWNERS[role]], name)]
    assert missing == []
    w.close()


def test_the_records_the_lanes_fill_are_laid_out_as_stated() -> None:
    assert CallRows._fields == contract.ROWS_FIELDS
    assert GradRows._fields == contract.GRAD_ROWS_FIELDS
    assert {SITES[OUT]: OUT, SITES[IN]: IN, SITES[HIDDEN]: HIDDEN,
                              "weight": WEIGHT} == contract.SITES


def test_the_cpp_takes_its_names_by_role_from_the_contract() -> None:
    """The C++ fills each role's name from the contract (``set_names``: every role, each
    into its own slot) and writes no attribute name of its own: a quoted name of the
    contract's that is not a role would be a second copy of it."""
    source = "".join(path.read_text() for path in build.CPP_SOURCES)
    pairs = re.findall(r'\{&names\.(\w+), "(\w+)"\}', source)
    assert [slot for slot, _ in pairs] == [role for _, role in pairs]  # each into its own
    assert sorted(role for _, role in pairs) == sorted(contract.NAMES)
    header = "".join(path.read_text() for path in build.CPP_HEADERS)
    declared = re.search(r"struct Names \{(.*?)\};", header, re.S)
    assert declared is not None
    assert sorted(re.findall(r"\*(\w+)", declared.group(1))) == sorted(contract.NAMES)
    own = set(contract.NAMES.values()) - set(contract.NAMES)
    for path in (*build.CPP_SOURCES, *build.CPP_HEADERS):
        quoted = set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', path.read_text()))
        assert not quoted & own, (path.name, quoted & own)
