"""The server tests' fixtures: the tiny model, a server on it, a client, and the same model in-process."""
import openai
import pytest

from helpers import make_tiny_model
from nanokv import LLM
from serving import ENGINE, MODEL, running_server


@pytest.fixture(autouse=True)
def loopback_without_proxy(monkeypatch):
    """A proxy set in the environment must not see these loopback requests."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / MODEL
    make_tiny_model(path, "llama")
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in-process, for the outputs the server must match."""
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(LLM(str(model_dir), **ENGINE)) as (base, app):
        yield base, app


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)
