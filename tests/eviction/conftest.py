"""The oracle's models, GQA and MHA, built once per module; and both CPU kernel backends."""
import pytest

import kernels
from oracle import build


@pytest.fixture(scope="module", params=["gqa", "mha"])
def model(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return build("gqa", tmp_path_factory.mktemp("gqa"))


@pytest.fixture(params=["cpu", "torch"])
def backend(request):
    """Engine tests that run on both CPU kernel backends: the CPU path and the references."""
    before = kernels.forced_backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(before)
