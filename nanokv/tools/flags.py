"""The one way the command lines (chat.py, bench.py, the server) turn engine options into flags."""
from __future__ import annotations

import argparse
import dataclasses

from nanokv.config import EngineConfig


def add_engine_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per engine option (--block-size, --kv-method, ...; all, or `only` those),
    typed from its annotation, default None: the engine's own. A bool option gets
    --NAME and --no-NAME."""
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" or (only is not None and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"engine option (default {f.default!r})")
        else:
            kind = next((types[t] for t in f.type.replace("|", " ").split() if t in types), str)
            parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(),
                                help=f"engine option (default {f.default!r})")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options a command line gave (add_engine_flags), for LLM(**options)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    return {name: value for name, value in vars(args).items() if name in names and value is not None}
