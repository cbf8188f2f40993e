import os
import sys
from pathlib import Path

import pytest
import torch

# The scripts at the repository's root (bench.py, chat.py) import as modules.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Each xdist worker takes its share of the cores: torch threads beyond it wait for each other's
# (every worker busy: a fraction of the speed, docs/PERF.md). A run without workers keeps torch's.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Before anything imports triton: without a GPU, Triton kernels run in its interpreter
# on CPU tensors; with one, the same tests run them compiled (tests/helpers.KERNEL_DEVICE).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models(family): the directory of a random 2-layer model of that family
    (helpers.make_tiny_model), written once per session and never changed by a test."""
    from helpers import make_tiny_model

    made = {}

    def directory(family: str) -> Path:
        if family not in made:
            made[family] = tmp_path_factory.mktemp(f"tiny-{family}")
            make_tiny_model(made[family], family)
        return made[family]
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tiny_models) -> Path:
    """The tiny llama most engine tests run (a module may take another family instead)."""
    return tiny_models("llama")


@pytest.fixture(scope="session")
def bundled_dir(tmp_path_factory):
    """The bundled SmolLM2 model, converted once per session into a fresh cache.

    A fresh cache means the suite always tests the current converter. For the
    rest of the session NANOKV_CACHE_DIR points at that cache, so
    `bundled_model_dir()` and `LLM()` reuse the conversion.
    """
    from models.gguf_convert import bundled_model_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOKV_CACHE_DIR", str(tmp_path_factory.mktemp("nanokv-cache")))
        yield bundled_model_dir()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run wherever CUDA exists and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
