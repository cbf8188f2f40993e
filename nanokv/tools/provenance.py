"""Which code made a measurement: the commit every benchmark record and report names.

A tree can be measured far from its repository: copied to a lent GPU machine without its
git history, or inside another checkout (whose commit would be the wrong one). So the
commit is NANOKV_COMMIT where it is set (the GPU report sets it for its parts from its
--commit), else git's, but only when this repository's root is itself the checkout's top;
otherwise None: unknown, never another tree's.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMIT_VARIABLE = "NANOKV_COMMIT"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def source_commit() -> str | None:
    """The commit of this tree (with "-dirty" if it has uncommitted changes), or None if unknown."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != ROOT:
        return None
    return _git("describe", "--always", "--dirty")
