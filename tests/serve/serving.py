"""What the server tests share: a real server on a loopback port, and the engine it runs."""
import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from nanokv import LLM, SamplingParams
from nanokv.serve.server import build_app

ENGINE = dict(dtype="float32", num_kv_blocks=160, max_model_len=256)
MODEL = "tiny"


@contextlib.contextmanager
def running_server(llm: LLM, api_key: str | None = None, allowed_origins: list[str] | None = None):
    """A real uvicorn server on a free loopback port, in a thread; yields (base URL, app)."""
    app = build_app(llm, MODEL, api_key, allowed_origins)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive() and not app.state.engine._thread.is_alive()


def wait_until_idle(base: str, timeout: float = 10.0) -> dict:
    """/health once nothing runs or waits (bounded in time); the caller checks the blocks."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{base}/health").json()
        if (health["running"] == health["waiting"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def wait_until_busy(base: str, timeout: float = 30.0) -> None:
    """Until /health shows the engine holding a request (one sent from another thread is in flight)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{base}/health").json()
        if health["running"] + health["waiting"] > 0:
            return
        time.sleep(0.02)
    raise AssertionError("no request reached the engine")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
