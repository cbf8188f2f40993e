"""An OpenAI-compatible HTTP server: python -m nanokv.serve [--model DIR_OR_HUB_ID] [engine options].

Endpoints: POST /v1/completions and /v1/chat/completions (stream: true gives
server-sent events), GET /v1/models and /v1/models/{id}, GET /health (no key needed;
engine stats). Web pages of --allowed-origins may call it (CORS).
Starlette on uvicorn; one engine thread steps the LLM for every request
(engine_thread.py); requests are checked in openai_api.py, responses built in responses.py.
SIGINT/SIGTERM: uvicorn stops taking connections and lets the open ones finish;
those still running after --drain-timeout seconds end with an error; then the
engine thread stops.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator
from importlib.metadata import version

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanokv import LLM, RequestOutput
from nanokv.serve.engine_thread import EngineError, EngineThread
from nanokv.serve.openai_api import APIError, ParsedRequest, from_engine, parse
from nanokv.serve.responses import Responder
from nanokv.tools.flags import add_engine_flags, interactive_options

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
DISCONNECT_POLL_S = 0.5   # how often a non-streaming request checks that its client is still there
log = logging.getLogger("nanokv.serve")


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


def build_app(llm: LLM, model_name: str, api_key: str | None = None,
              allowed_origins: list[str] | None = None) -> Starlette:
    """The server's ASGI app. It owns `llm` from now on: only its engine thread touches it.
    allowed_origins: the web origins whose pages may call it (CORS; None: none, "*": any)."""
    engine = EngineThread(llm)
    fingerprint = system_fingerprint(llm)
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "nanokv",
            "max_model_len": llm.config.max_model_len}

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **engine.stats})

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:
        check_key(request)
        if request.path_params["model_id"] != model_name:
            raise APIError(404, f"The model {request.path_params['model_id']!r} does not exist; this server serves "
                           f"{model_name!r}", "model", code="model_not_found")
        return JSONResponse(card)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        check_key(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if isinstance(body, dict) and body.get("model") not in (None, model_name):
            raise APIError(404, f"The model {body['model']!r} does not exist; this server serves "
                           f"{model_name!r}", "model", code="model_not_found")
        parsed = parse(body, chat, llm.tokenizer, llm.config.max_model_len)
        keys, results = engine.submit(parsed.requests)
        try:
            _, accepted = await results.get()
        except asyncio.CancelledError:
            engine.abort(keys)
            raise
        if isinstance(accepted, Exception):
            raise from_engine(accepted, list(body))
        responder = Responder(chat, model_name, parsed, llm.tokenizer, fingerprint)
        if parsed.stream:
            return StreamingResponse(stream_events(keys, results, parsed, responder),
                                     media_type="text/event-stream")
        try:
            outs = await last_outputs(request, results, len(keys))
        except (ClientGone, APIError, asyncio.CancelledError):
            engine.abort(keys)
            raise
        return JSONResponse(responder.whole(outs))

    async def last_outputs(request: Request, results: asyncio.Queue, count: int) -> list[RequestOutput]:
        """Each request's finished output, in order; every DISCONNECT_POLL_S, a check that the
        client is still there."""
        outs: dict[int, RequestOutput] = {}
        clock = asyncio.get_running_loop().time
        check_at = clock() + DISCONNECT_POLL_S
        while len(outs) < count:
            with contextlib.suppress(TimeoutError):
                index, out = await asyncio.wait_for(results.get(), max(check_at - clock(), 0))
                failed(out)
                if out.finished:
                    outs[index] = out
            if clock() >= check_at:
                if await request.is_disconnected():
                    raise ClientGone
                check_at = clock() + DISCONNECT_POLL_S
        return [outs[i] for i in range(count)]

    async def stream_events(keys: list[int], results: asyncio.Queue, parsed: ParsedRequest,
                            responder: Responder) -> AsyncIterator[str]:
        """The SSE stream, the choices' chunks as they come; Starlette cancels it when the client
        disconnects: then abort."""
        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"
        outs: dict[int, RequestOutput] = {}
        try:
            if responder.chat:   # the role comes first, as OpenAI sends it
                for index in range(len(keys)):
                    yield event(responder.role_chunk(index))
            while len(outs) < len(keys):
                index, out = await results.get()
                try:
                    failed(out)
                except APIError as error:
                    yield event(error.body())
                    break
                if out.finished:
                    outs[index] = out
                chunk = responder.chunk(index, out)
                if chunk is not None:
                    yield event(chunk)
            else:
                if parsed.include_usage:
                    yield event(responder.usage_chunk([outs[i] for i in range(len(keys))]))
            yield "data: [DONE]\n\n"
        finally:
            if len(outs) < len(keys):
                engine.abort(keys)

    def failed(out) -> None:
        """Raise the APIError of an engine failure or a request that ended with "error"."""
        if isinstance(out, EngineError):
            raise APIError(503, str(out), type="server_error")
        if out.finish_reason == "error":
            raise APIError(500, f"the request failed in the engine: {out.error}", type="server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        yield
        engine.stop()
        log.info("engine stopped")

    async def api_error(request: Request, error: APIError) -> Response:
        return JSONResponse(error.body(), status_code=error.status)

    async def http_error(request: Request, error: HTTPException) -> Response:   # 404, 405
        return JSONResponse(APIError(error.status_code, error.detail).body(), status_code=error.status_code)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/v1/models/{model_id:path}", model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], exception_handlers={APIError: api_error, HTTPException: http_error}, lifespan=lifespan,
        middleware=[Middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])]
        if allowed_origins else None)
    app.state.engine = engine
    return app


def system_fingerprint(llm: LLM) -> str:
    """What OpenAI's system_fingerprint says: which engine and settings made a response (its
    version, and a hash of the engine's options and model's shape)."""
    settings = repr((sorted(dataclasses.asdict(llm.config).items()), llm.model_config, str(llm.dtype)))
    return f"fp_nanokv-{version('nanokv')}-{hashlib.sha256(settings.encode()).hexdigest()[:10]}"


# ----- command line -----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory or hub id (default: bundled SmolLM2-135M)")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health)")
    parser.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="web origins whose pages may call the server, e.g. http://localhost:3000 or * for any "
                             "(CORS; default: none)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGINT/SIGTERM, how long requests in flight may take to finish before they end "
                             "with an error (default 30)")
    add_engine_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    try:
        llm = LLM(args.model, **interactive_options(args))
    except (ValueError, OSError, TypeError, torch.OutOfMemoryError) as error:
        raise SystemExit(f"nanokv.serve: {error}") from None
    name = args.served_model_name or args.model or BUNDLED_MODEL_NAME
    app = build_app(llm, name, args.api_key, args.allowed_origins)
    # What start-up left lives as long as the server: Python's full collections then pass over the
    # requests' objects alone, not also its ~240k (~0.2 s each, every stream stalled meanwhile).
    gc.collect()
    gc.freeze()
    log.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.drain_timeout + 5))
    handle_exit = server.handle_exit

    def drain(sig, frame) -> None:   # uvicorn's signal handler, and a deadline for what is in flight
        if not server.should_exit:
            why = f"the server stopped: this request ran past the drain time of {args.drain_timeout} s"
            deadline = threading.Timer(args.drain_timeout, app.state.engine.end_all, (why,))
            deadline.daemon = True   # an early end of the drain does not wait for it
            deadline.start()
        handle_exit(sig, frame)
    server.handle_exit = drain
    server.run()
