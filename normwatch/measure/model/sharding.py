"""Sharded parameters: this rank's part of a DTensor, and the unsharded parameters FSDP2
swaps into its modules for each forward.

    >>> local(param)                      # a DTensor's local shard; a plain tensor itself
    >>> unsharded_params(model)           # {(id(module), "weight"): unsharded Parameter}

FSDP2 (``fully_shard``) all-gathers each parameter into one unsharded ``nn.Parameter``
per parameter, made at the first forward and reused after (its storage is freed and
refilled); the forward reads it and the backward fills its gradient before the
reduce-scatter. Eager norm hooks see it as ``module.weight`` inside the forward; code
compiled around the module never runs Python there, so the weight hook is moved onto it
from outside, between steps. FSDP2 offers no public accessor: its private attributes are
read defensively, and without them the weight gradient of compiled FSDP2 blocks is not
measured (as before), nothing fails.
"""

from __future__ import annotations

import torch
from torch import nn


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; a plain tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def unsharded_params(root: nn.Module) -> dict[tuple[int, str], torch.Tensor] | None:
    """FSDP2's unsharded parameters under ``root`` by ``(id(module), parameter name)``;
    empty before the first forward made them, ``None`` where no module is sharded."""
    found: dict[tuple[int, str], torch.Tensor] | None = None
    for module in root.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if not callable(state_of):
            continue
        found = {} if found is None else found
        state = state_of()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before the list of groups
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for param in getattr(group, "fsdp_params", ()):
                info = getattr(param, "_module_info", None)
                unsharded = getattr(param, "_unsharded_param", None)
                if info is not None and isinstance(unsharded, torch.Tensor):
                    found[(id(info.module), info.param_name)] = unsharded
    return found
