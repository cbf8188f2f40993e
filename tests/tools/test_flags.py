"""The engine options as command-line flags (chat.py, bench.py and the server make them one way)."""
import argparse
import dataclasses

import pytest

from nanokv.config import EngineConfig
from nanokv.tools.flags import add_engine_flags, engine_options, interactive_options, interactive_threads


def parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_flags(p, **kwargs)
    return p


def test_every_engine_option_is_a_flag_typed_from_its_annotation():
    args = parser().parse_args(["--kv-budget", "512", "--kv-cache-gb", "0.5", "--kv-method", "h2o",
                                "--no-enable-prefix-caching", "--enforce-eager", "--threads", "3"])
    assert engine_options(args) == dict(kv_budget=512, kv_cache_gb=0.5, kv_method="h2o", enable_prefix_caching=False,
                                        enforce_eager=True, num_threads=3)
    assert engine_options(parser().parse_args([])) == {}   # nothing given: the engine's defaults
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert {a.dest for a in parser()._actions} - {"help"} == names


def test_only_some_flags_and_a_bad_value():
    p = parser(only=("num_threads", "dtype"))
    assert engine_options(p.parse_args(["--num-threads", "2", "--dtype", "bf16"])) == dict(num_threads=2, dtype="bf16")
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-budget", "512"])
    with pytest.raises(SystemExit):
        p.parse_args(["--threads", "many"])


def test_chat_and_the_server_leave_a_core_free_unless_told(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert interactive_threads() == 3
    assert interactive_options(parser().parse_args(["--kv-budget", "64"])) == dict(num_threads=3, kv_budget=64)
    assert interactive_options(parser().parse_args(["--threads", "4"])) == dict(num_threads=4)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert interactive_threads() == 1
