"""What a norm call's arguments hold: its input, its output, other tensors, dtypes.

Metadata only (types, shapes, dtypes, autocast flags): the eager hook and the traced one
read calls the same way, and nothing here touches a tensor's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

INPUT_KWARGS = ("hidden_states", "input", "x", "inputs")
"""Keyword names a norm's input goes by, looked up first."""


def input_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The norm's input: its first positional tensor (the common case first), else the
    first tensor found."""
    return args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args, kwargs)


def output_of(output: Any) -> torch.Tensor | None:
    """The norm's output tensor (the first one of a tuple or list)."""
    if isinstance(output, torch.Tensor):
        return output
    return _first_tensor(output if isinstance(output, tuple | list) else (output,), {})


def other_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any], x: torch.Tensor) -> bool:
    """Whether the call had a tensor input besides ``x`` (a gated norm's gate: the
    formula of ``x`` alone no longer gives the output)."""
    return any(isinstance(v, torch.Tensor) and v is not x
               for v in (*args, *kwargs.values()))


def dtypes(module: nn.Module, x: torch.Tensor, y: torch.Tensor | None
           ) -> tuple[torch.dtype, torch.dtype | None, torch.dtype | None, torch.dtype | None,
                      str]:
    """Input, weight, output and autocast dtypes of a call, and the device type (reads
    flags and metadata only: traceable)."""
    weight = getattr(module, "weight", None)
    device_type = "cpu" if x.is_cpu else x.device.type
    amp = (torch.get_autocast_dtype(device_type)
           if torch.is_autocast_enabled(device_type) else None)
    return (x.dtype, weight.dtype if isinstance(weight, torch.Tensor) else None,
            None if y is None else y.dtype, amp, device_type)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_tensor(
    args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any]
) -> torch.Tensor | None:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    for name in INPUT_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return value
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value
    return None
