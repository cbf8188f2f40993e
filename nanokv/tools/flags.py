"""The one way the command lines (chat.py, bench.py, the server) turn engine options into flags."""
from __future__ import annotations

import argparse
import dataclasses
import os

from nanokv.config import EngineConfig

ALIASES = {"num_threads": ("--threads",)}   # shorter flags that the command lines have always taken


def add_engine_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per engine option (--block-size, --kv-method, ...; all, or `only` those),
    typed from its annotation, default None: the engine's own. A bool option gets
    --NAME and --no-NAME."""
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" or (only is not None and f.name not in only):
            continue
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
        if f.type.startswith("bool"):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None,
                                help=f"engine option (default {f.default!r})")
        else:
            kind = next((types[t] for t in f.type.replace("|", " ").split() if t in types), str)
            parser.add_argument(*flags, type=kind, default=None, metavar=f.name.upper(),
                                help=f"engine option (default {f.default!r})")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options a command line gave (add_engine_flags), for LLM(**options)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    return {name: value for name, value in vars(args).items() if name in names and value is not None}


def interactive_options(args: argparse.Namespace) -> dict:
    """engine_options for chat.py and the server: the CPU threads, unless given, interactive_threads()."""
    return {"num_threads": interactive_threads(), **engine_options(args)}


def interactive_threads() -> int:
    """The CPU threads chat.py and the server take unless told: all cores but one. With every
    core, one other busy program makes each op wait for the thread it displaced (on 2 cores,
    a third of the speed); with one core left free, nothing changes (docs/PERF.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)
