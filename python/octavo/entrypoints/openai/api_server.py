"""``octavo serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /version, /tokenize,
/detokenize, /metrics. With an API key, every route but /health, /version and /metrics needs
``Authorization: Bearer KEY`` (load balancers and Prometheus scrape those three). vLLM guards
only the /v1 routes; Octavo guards /tokenize and /detokenize too, since they run the tokenizer
and chat templates for anyone who asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.util
import json
import logging
import os
import reprlib
import uuid
from collections.abc import Awaitable
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ... import __version__
from .chat import ChatRun
from .completions import CompletionRun
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from .serving import ServedModel

logger = logging.getLogger("octavo.server")


# Request bodies beyond this get a 413 (--max-request-bytes).
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# Routes that answer without an API key.
OPEN_ROUTES = frozenset({"/health", "/version", "/metrics"})
# Routes whose requests GET /load counts while they run (vLLM's load-aware routes).
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def build_app(served: ServedModel, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tokenizer_info: bool = False,
              load_tracking: bool = False, request_id_headers: bool = False) -> FastAPI:
    """The routes over ``served``; the flags turn on vLLM's optional endpoints and headers
    (--enable-tokenizer-info-endpoint, --enable-server-load-tracking, --enable-request-id-headers)."""
    app = FastAPI(title="Octavo", version=__version__, lifespan=_lifespan(served))
    _add_error_handlers(app)
    if request_id_headers:
        app.add_middleware(_RequestIdHeader)
    if api_key:
        _add_api_key_check(app, api_key)
    if load_tracking:
        load = _Load()
        app.add_middleware(_LoadCounter, load=load)

        @app.get("/load")
        async def server_load() -> dict:
            return {"server_load": load.in_flight}

    if tokenizer_info:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            return served.tokenizer_info()

    async def parse(raw: Request, model):
        return await _parse(raw, model, max_request_bytes)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine runs and its steps succeed; 503 otherwise."""
        ok = served.engine.is_healthy
        return Response(status_code=HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": name, "object": "model", "created": served.created, "owned_by": "octavo", "root": served.root,
                 "parent": None, "max_model_len": served.max_model_len} for name in served.names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.engine.stats.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        request = await parse(raw, TokenizeRequest)
        served.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("Give exactly one of prompt and messages.", param="prompt")
        if request.messages is not None:
            text = await served.render_chat(request.messages, request.add_generation_prompt,
                                            request.continue_final_message, request.chat_template,
                                            request.chat_template_kwargs)
            tokens = await served.encode(text, add_special_tokens=False, param="messages")
        else:
            tokens = await served.encode(request.prompt, request.add_special_tokens)
        result = {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}
        if request.return_token_strs:
            result["token_strs"] = served.tokenizer.convert_ids_to_tokens(tokens)
        return result

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        request = await parse(raw, DetokenizeRequest)
        served.check_model(request.model)
        vocab = len(served.tokenizer)
        if any(t < 0 or t >= vocab for t in request.tokens):
            raise APIError(f"Token ids must be in [0, {vocab}).", param="tokens")
        return {"prompt": await served.decode(request.tokens)}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        run = CompletionRun(served, await parse(raw, CompletionRequest))
        await run.prepare()
        return await _respond(raw, run)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        run = ChatRun(served, await parse(raw, ChatCompletionRequest))
        await run.prepare()
        return await _respond(raw, run)

    return app


async def _parse(raw: Request, model, max_bytes: int):
    """The body as ``model``, or a 400 naming the first bad field (vLLM answers 400, not 422);
    413 for a body over ``max_bytes``."""
    body = await _read_body(raw, max_bytes)
    try:
        body = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:  # ValueError: bad JSON, or an integer of 5000 digits
        raise APIError(f"The body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError("The body is not valid JSON: it is nested too deeply.") from None
    if not isinstance(body, dict):
        raise APIError("The body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None
    except RecursionError:
        raise APIError("The body is nested too deeply.") from None


async def _read_body(raw: Request, max_bytes: int) -> bytes:
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(f"The request body is larger than the server's limit of {max_bytes} bytes.",
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


_SHORT = reprlib.Repr()  # a bounded repr of what the client sent: never deep, never long
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def _validation_error(errors) -> APIError:
    first = errors[0]
    param = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return APIError(f"{param}: {first.get('msg')} (got {_SHORT.repr(first.get('input'))})", param=param or None)


async def _respond(raw: Request, run) -> Response:
    """Streams server-sent events, or waits for the whole response. Either way a client that
    disconnects aborts its requests (StreamingResponse cancels the generator; the wait below
    races the response against the disconnect)."""
    if run.request.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    result = await _unless_disconnected(raw, run.response())
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _unless_disconnected(raw: Request, work: Awaitable):
    """The result of ``work``, or None when the client disconnected first (``work`` is then
    cancelled, which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        error = _validation_error(e.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(404)
    async def not_found(request: Request, _) -> JSONResponse:
        return JSONResponse(error_body(f"{request.url.path} not found", 404), status_code=404)

    @app.exception_handler(405)
    async def method_not_allowed(request: Request, _) -> JSONResponse:
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}", 405),
                            status_code=405)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("request failed")  # the details stay in the log
        return JSONResponse(error_body("Internal server error.", 500), status_code=500)


def _add_api_key_check(app: FastAPI, api_key: str) -> None:
    app.add_middleware(_APIKeyCheck, expected=f"Bearer {api_key}".encode())


class _RequestIdHeader:
    """X-Request-Id on every response: the client's own, or a new one (as vLLM's header)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _Load:
    in_flight = 0


class _LoadCounter:
    """Counts generation requests from their arrival until their response (stream included) ends."""

    def __init__(self, app, load: _Load):
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send) -> None:
        counted = scope["type"] == "http" and scope["path"] in GENERATION_ROUTES
        self.load.in_flight += counted
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= counted


class _APIKeyCheck:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which would sit between streaming
    responses and the client's disconnect)."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in OPEN_ROUTES \
                and not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected):
            response = JSONResponse(error_body("Invalid or missing API key.", 401), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _lifespan(served: ServedModel):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # uvicorn has stopped taking requests and waited (up to its graceful timeout) for the
        # in-flight ones; whatever is still running is aborted here, then the engine stops.
        served.engine.shutdown()
        served.close()
    return lifespan


def api_key_from(args_key: str | None) -> str | None:
    return args_key or os.environ.get("OCTAVO_API_KEY") or None


def core_in_own_process() -> bool:
    """The server runs the engine core in a process of its own unless OCTAVO_ENABLE_MULTIPROCESSING=0,
    or pyzmq / msgspec are missing (a host without a package registry)."""
    if os.environ.get("OCTAVO_ENABLE_MULTIPROCESSING", "1") == "0":
        return False
    missing = [m for m in ("zmq", "msgspec", "cloudpickle") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"octavo: the engine core runs in the server's process: {', '.join(missing)} not installed")
    return not missing


def served_model(args) -> ServedModel:
    """Loads the model and starts the engine thread."""
    from ...engine.async_llm import AsyncLLM
    from ...llm import LLM
    from ...loader import load_tokenizer
    from .reasoning_parsers import make_parser as make_reasoning_parser
    from .tool_calls import ToolSettings

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("octavo serve: --enable-auto-tool-choice requires --tool-call-parser")
    llm = LLM(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, seed=args.seed,
              max_model_len=args.max_model_len, block_size=args.block_size,
              enable_chunked_prefill=args.enable_chunked_prefill, scheduling_policy=args.scheduling_policy,
              generation_config=args.generation_config,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, max_logprobs=args.max_logprobs,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
              distributed_executor_backend=args.distributed_executor_backend,
              structured_outputs_config=args.structured_outputs_config, logits_processors=args.logits_processors,
              speculative_config=args.speculative_config, multiprocess=core_in_own_process())
    engine = llm.llm_engine
    names = args.served_model_name or [args.model or "SmolLM2-135M-Instruct"]
    tokenizer = load_tokenizer(args.tokenizer or engine.model_path)
    try:
        reasoning = make_reasoning_parser(args.reasoning_parser, tokenizer) if args.reasoning_parser else None
    except ValueError as e:
        raise SystemExit(f"octavo serve: {e}") from None
    return ServedModel(engine=AsyncLLM(engine, args.max_waiting_requests, names[0]),
                       tokenizer=tokenizer, names=names,
                       root=str(engine.model_path), max_model_len=engine.max_model_len,
                       sampling_defaults=engine.generation_config.sampling_defaults, max_logprobs=args.max_logprobs,
                       max_n=args.max_n, request_timeout=args.request_timeout,
                       chat_template=load_chat_template(args.chat_template),
                       enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                       return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                       tool_settings=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser,
                                                  args.exclude_tools_when_tool_choice_none),
                       reasoning_parser=reasoning)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file, or the template itself. As in vLLM, a value without any of the
    characters a template needs ({, }, newline) is a path, and must exist."""
    if value is None:
        return None
    if any(c in value for c in "{}\n"):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r} looks like a path, but there is no such file")
    return path.read_text()


def run(args) -> None:
    """Serves until SIGINT/SIGTERM."""
    import uvicorn

    served = served_model(args)
    app = build_app(served, api_key_from(args.api_key), args.max_request_bytes,
                    tokenizer_info=args.enable_tokenizer_info_endpoint,
                    load_tracking=args.enable_server_load_tracking,
                    request_id_headers=args.enable_request_id_headers)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT once it has shut down cleanly
        pass
    finally:
        served.engine.shutdown()
        served.close()
