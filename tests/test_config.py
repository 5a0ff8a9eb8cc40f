"""Options are validated once, at setup, with errors that name the option."""

from __future__ import annotations

import pytest

from normwatch.config import WatchConfig
from normwatch.errors import ConfigError
from normwatch.records import Limits


@pytest.mark.parametrize(("options", "message"), [
    ({"flush_every": 0}, "'flush_every' must be an int >= 1: got 0"),
    ({"stats_every": True}, "'stats_every' must be an int >= 1: got True"),
    ({"fp16_limit": -1}, "'fp16_limit' must be a finite number in (0, inf]: got -1"),
    ({"eps_tol": 1.0}, "'eps_tol' must be a finite number in (0, 1): got 1.0"),
    ({"kernel": "cuda"}, "'kernel' must be one of 'auto', 'torch', 'triton': got 'cuda'"),
    ({"raise_on": "fatal"}, "'raise_on' must be one of None, 'info', 'warning', 'critical'"),
    ({"prometheus_port": 70000}, "'prometheus_port' must be <= 65535: got 70000"),
    ({"prometheus_certfile": "c.pem"}, "'prometheus_certfile' and 'prometheus_keyfile' go"),
    ({"include": [3]}, "'include' must be a sequence of str patterns: got int 3"),
    ({"sinks": [42]}, "'sinks' must hold callables: got int"),
    ({"report_dir": 3}, "'report_dir' must be a folder path or None: got 3"),
    ({"report_dir": ""}, "'report_dir' must be a folder path or None: got ''"),
    ({"flush_evry": 5}, "unknown option 'flush_evry'; did you mean 'flush_every'?"),
])
def test_bad_options_name_the_option_and_the_value(options: dict[str, object],
                                                   message: str) -> None:
    with pytest.raises(ConfigError) as info:
        WatchConfig.from_options(**options)
    assert message in str(info.value)


def test_sequences_and_single_values_are_normalised() -> None:
    config = WatchConfig.from_options(include="blocks.*", exclude=None, sinks=print)
    assert (config.include, config.exclude, config.sinks) == (("blocks.*",), (), (print,))


def test_limits_carry_the_thresholds() -> None:
    config = WatchConfig.from_options(fp16_limit=100.0, eps_tol=0.05, common_mode_tol=0.5,
                                      common_mode_fraction=0.2, output_tol=0.01)
    assert config.limits == Limits(100.0, 0.05, 0.5, 0.2, 0.01)
    assert WatchConfig().limits == Limits()
    assert Limits(fp16_limit=128.0).headroom(64.0) == 2.0 and Limits().headroom(None) is None
