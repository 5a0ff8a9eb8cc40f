"""The options both callbacks share (no framework needed)."""

from __future__ import annotations

import pytest
from normwatch.integrations.common import trainer_config, validate

import normwatch


def test_defaults_inside_a_trainer() -> None:
    one = trainer_config({}, flush_every=50, rank=0, world_size=1)
    assert (one.flush_every, one.rank, one.report_console) == (50, None, True)
    quiet = trainer_config({}, flush_every=0, rank=0, world_size=1, quiet=True)
    assert (quiet.flush_every, quiet.report_console) == (1, False)
    mine = trainer_config({"flush_every": 3, "report_console": True}, flush_every=50, rank=0,
                          world_size=1, quiet=True)
    assert (mine.flush_every, mine.report_console) == (3, True)  # the user's word wins


def test_several_ranks_label_reports_print_once_and_serve_one_port_each() -> None:
    rank3 = trainer_config({"prometheus_port": 9464, "report_console": True}, flush_every=10,
                           rank=3, world_size=4, local_rank=1)
    assert (rank3.rank, rank3.report_console, rank3.prometheus_port) == (3, False, 9465)
    rank0 = trainer_config({"prometheus_port": 9464}, flush_every=10, rank=0, world_size=4)
    assert (rank0.rank, rank0.report_console, rank0.prometheus_port) == (0, True, 9464)


def test_validate_fails_at_construction_and_keeps_a_copy() -> None:
    options = {"fp16_limit": 64.0}
    kept = validate(options)
    options["fp16_limit"] = 1.0
    assert kept == {"fp16_limit": 64.0}
    with pytest.raises(normwatch.ConfigError, match="'stats_every' must be an int >= 1: got 0"):
        validate({"stats_every": 0})
