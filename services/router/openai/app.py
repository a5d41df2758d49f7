"""OpenAI-compatible HTTP front-end (fastapi): chat completions (SSE streaming), models,
health, metrics. Every failure answers OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` with a matching status; bad input is a
4xx, never a 500.

Tandem extension: the last chunk (or the response) carries
`"tandem": {"timings": {stage: ms, ..., "encoder_ranges": [...]}, "cached_image_tokens": n,
"request_id": id, "encoder": addr, "language": addr, "encoder_attempts": n, "attempts": n,
"resumes": n}` (the timings' shape: format.timings).
"""

from __future__ import annotations

import asyncio
import json
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from tandem import tracing
from tandem.services.router.core import RouterCore, Run
from tandem.services.router.errors import RouterError
from tandem.services.router.metrics import HttpStatusCounter
from tandem.services.router.openai import format as fmt
from tandem.services.router.openai.chat import (
    ChatCompletionRequest,
    DetokenizeBody,
    TokenizeBody,
    echo_text,
    request_id_from_header,
    to_chat_request,
    to_tokenize_request,
)
from tandem.services.router.openai.completions import (
    CompletionRequest,
    CompletionShape,
    to_completion_request,
)
from tandem.services.router.openai.errors import openai_body, openai_param
from tandem.services.router.openai.guard import Guard, error_response
from tandem.services.router.openai.openapi import ERROR_RESPONSES, document
from tandem.services.router.openai.sampling import VLLM_REFUSED
from tandem.services.router.reasoning import ReasoningParser, reasoning_of
from tandem.services.router.request import Caller, Door, Output, Query
from tandem.v1 import language_pb2

# Names pydantic puts into an error's location for the member of a union it tried (the
# `str` of `str | list[Part]`, `list[tagged-union[...]]`): not a place in the body.
_UNION_MEMBER = re.compile(r"^(str|[\w-]+\[.*\])$")


# A location in a video given as frames (the body's `video` list of a `video` part), as the
# body spells it: openai_param (openai/errors.py) reads a param as the wire spells it,
# where that list is `video.frames` (and a bare `video` is a video_url part).
_BODY_FRAMES = re.compile(r"^(messages\[\d+\]\.content\[\d+\])\.video(?=$|\[)")


def _loc(loc) -> str:
    """An error's location as the body spells it: `messages[0].content[1].video_url.fps`.
    Union members are left out, and so is a content part's tag (its `type`, which pydantic
    puts before the part's fields); a frames `video` list is spelled as the wire spells it
    (`...content[1].video.frames[2]`, which openai_param turns back into the body's
    `...content[1].video[2]`)."""
    parts = [str(p) for p in loc if p != "body" and not _UNION_MEMBER.match(str(p))]
    parts = [p for i, p in enumerate(parts)
             if not (i >= 2 and parts[i - 2] == "content" and parts[i - 1].isdigit())
             and not (i + 1 < len(parts) and parts[i + 1] == p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return _BODY_FRAMES.sub(r"\1.video.frames", out)


def build_app(core: RouterCore) -> FastAPI:
    app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None)
    cfg = core.cfg

    @app.exception_handler(RouterError)
    async def _router_error(_req, err: RouterError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        # the deepest error: where a union's members all failed, the one that got furthest
        # (a content list's bad part, rather than "content is not a string")
        first = (max(exc.errors(), key=lambda e: len(e.get("loc", ()))) if exc.errors()
                 else {"loc": (), "msg": "invalid request"})
        param = None if first.get("type") == "json_invalid" else (_loc(first.get("loc", ())) or None)
        if first.get("type") == "extra_forbidden" and param in VLLM_REFUSED:
            msg = f"{param} is not supported: {VLLM_REFUSED[param]}"  # and why
        elif first.get("type") == "extra_forbidden":  # a field we do not honour: say so
            msg = (f"{openai_param(param)}: not supported by this server (refused, never "
                   "silently ignored)")
        elif first.get("type") == "json_invalid":  # our words; the parser's as the detail
            detail = (first.get("ctx") or {}).get("error") or first["msg"]
            msg = f"the request body is not valid JSON ({detail})"
        else:
            msg = f"{openai_param(param) if param else 'the request body'}: {first['msg']}"
        return error_response(RouterError("INVALID_ARGUMENT", msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        code = {404: "NOT_FOUND", 405: "INVALID_ARGUMENT", 413: "TOO_LARGE"}.get(
            exc.status_code, "INVALID_ARGUMENT"
        )
        body = openai_body(RouterError(code, str(exc.detail)))
        return JSONResponse(body, status_code=exc.status_code)

    # NOTE: a plain ASGI middleware, not `@app.middleware("http")`: Starlette's
    # BaseHTTPMiddleware hides the client's disconnect from `request.is_disconnected()`,
    # and a non-streaming request would then run to the end for a caller that is gone.
    app.add_middleware(Guard, cfg=cfg, refusals=core.refusals, tenants=core.tenants)
    # NOTE: added last, so outermost: it also counts the answers Guard gives (401, 413).
    app.add_middleware(HttpStatusCounter, metrics=core.metrics)

    def health_answer(ok: bool) -> JSONResponse:
        h = core.health()
        tiers = {"encoder": h.encoder, "language": h.language}
        if h.prefill is not None:  # E/P/D: `language` is the decode instances
            tiers["prefill"] = h.prefill
        body = {
            "status": h.status.value,
            "ready": h.serves_all,
            "draining": h.draining,
            "tiers": {name: {"state": t.state.value, "healthy": t.healthy,
                             "instances": t.instances} for name, t in tiers.items()},
            "encoders": h.encoder.healthy,  # the healthy counts, as before `tiers`
            "languages": h.language.healthy,
            "inflight": core.admission.inflight,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)
    async def health():
        """200 while the router can serve some request (a language instance is healthy:
        text chats, completions, /tokenize), each tier's state in the body (health.py)."""
        return health_answer(core.health().serves_some)

    @app.get("/ready")
    @app.head("/ready", include_in_schema=False)
    async def ready():
        """200 only while every tier has a healthy instance (image chats too): for a load
        balancer that wants every tier behind the router it picks."""
        return health_answer(core.health().serves_all)

    @app.get("/version")
    async def version():
        """The server's version (as vLLM's /version answers it)."""
        return {"version": tandem.version()}

    @app.get("/metrics")
    async def metrics(request: Request):
        core.refresh_gauges()
        # OpenMetrics (with the latency histograms' trace-id exemplars) when the scraper
        # asks for it, Prometheus text otherwise: as the tiers' metrics servers answer
        body, media_type = core.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=media_type)

    def model_entry(name: str, max_model_len: int | None) -> dict:
        """One served name as vLLM's /v1/models lists it: `root` the checkpoint, `parent`
        null (no adapters here), `max_model_len` the language tier's (null while no
        language instance is up to say it; asked once per answer, not once per name)."""
        return {"id": name, "object": "model", "created": core.started, "owned_by": "tandem",
                "root": core.model_root(), "parent": None, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        limit = await core.max_model_len()
        return {"object": "list",
                "data": [model_entry(name, limit) for name in core.served_names()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        core.check_model(model_id)
        name = model_id if model_id in core.served_names() else core.model_name()
        return model_entry(name, await core.max_model_len())

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request):
        query, rid = _translated(core, body, request, to_chat_request)
        reasoning = reasoning_of(ReasoningParser(cfg.reasoning_parser),
                                 body.chat_template_kwargs,
                                 query.sampling.HasField("structured_output"))
        shape = fmt.ChatShape(query.request_id, body.model or core.model_name(), query.tools,
                              echo_text(body), _continuous_usage(body),
                              body.return_tokens_as_token_ids, reasoning)
        return await _serve(core, query, body, shape, rid, request)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        query, rid = _translated(core, body, request, to_completion_request)
        shape = CompletionShape(query.request_id, body.model or core.model_name(),
                                query.prompt if body.echo else "", _continuous_usage(body),
                                body.return_tokens_as_token_ids)
        return await _serve(core, query, body, shape, rid, request)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeBody):
        core.check_model(body.model)
        msg = to_tokenize_request(body)
        resp = await core.language_call("Tokenize", msg)
        return {"count": len(resp.token_ids), "max_model_len": resp.max_model_len,
                "tokens": list(resp.token_ids)}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeBody):
        core.check_model(body.model)
        resp = await core.language_call(
            "Detokenize", language_pb2.DetokenizeRequest(token_ids=body.tokens))
        return {"prompt": resp.text}

    document(app)  # the statuses each route answers, in /openapi.json
    return app


def _translated(core: RouterCore, body, request: Request, convert) -> tuple[Query, str]:
    """(the front-end-independent Query, its request id) of a generation body: the model
    checked, the body converted by `convert(body, rid)` (RouterError on bad input)."""
    core.check_model(body.model)
    rid = request_id_from_header(request.headers.get("x-request-id"))
    return convert(body, rid), rid


def _caller(request: Request) -> Caller:
    """Who sent `request`: its client key and tenant (set by guard.Guard), its
    traceparent header."""
    return Caller(Door.HTTP, request.state.client_id, request.state.tenant,
                  tracing.from_headers(request.headers))


def _continuous_usage(body) -> bool:
    """stream_options.continuous_usage_stats: usage on every chunk, with include_usage (as
    vLLM streams it); alone it is refused by name rather than ignored."""
    opts = body.stream_options
    if opts is None or not opts.continuous_usage_stats:
        return False
    if not opts.include_usage:
        raise RouterError("INVALID_ARGUMENT", "continuous_usage_stats needs include_usage "
                          "(usage is streamed only when included, as in vLLM)",
                          "stream_options.continuous_usage_stats")
    return True


async def _serve(core: RouterCore, query: Query, body, shape, rid: str, request: Request):
    """Run `query` (RouterCore.generate) and answer whole or as server-sent events in the
    API's `shape` (`ChatShape`, `CompletionShape`). The run ends (Run.end) with the
    answer: at once for a whole one, when the stream ends for a stream."""
    headers = {"X-Request-Id": rid}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    run = core.generate(query, _caller(request))
    try:
        if body.stream and run.whole:
            # a tool call is known only once its closing tag is out: answer whole
            outputs = [o for _, o in await _collect_or_disconnect(run, request)]
            run.end()
            return StreamingResponse(
                shape.tool_stream(outputs, include_usage),
                media_type="text/event-stream", headers=headers)
        if body.stream:
            # Wait for the first Output so errors before output get a real status code.
            first = await _first_or_disconnect(run, request)
            # NOTE: if the client is gone before the body starts, the stream never runs its
            # finally; the background task ends the run and closes the choices' streams.

            async def cleanup():
                run.end("CANCELLED")  # a no-op once the stream has ended it
                await _close_quietly(run)

            return StreamingResponse(
                _sse(run, first, shape, include_usage), media_type="text/event-stream",
                background=BackgroundTask(cleanup), headers=headers,
            )
        result = await _collect_or_disconnect(run, request)
        run.end()
        choices = [[o for i, o in result if i == k] for k in range(run.n)]
        return JSONResponse(shape.complete(choices), headers=headers)
    except RouterError as err:
        run.end(err.code, err.message)
        raise
    except BaseException:
        run.end("CANCELLED")
        raise


async def _watch_disconnect(task: asyncio.Future, request: Request) -> None:
    """Cancel `task` when the HTTP client goes away (non-streaming requests)."""
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()


async def _first_or_disconnect(run: Run, request: Request) -> tuple[int, Output]:
    agen = run.outputs
    task = asyncio.ensure_future(agen.__anext__())
    try:
        await _watch_disconnect(task, request)
        return task.result()
    except (asyncio.CancelledError, StopAsyncIteration):
        await agen.aclose()
        raise RouterError("CANCELLED", "client disconnected") from None
    except BaseException:
        await agen.aclose()
        raise


async def _collect_or_disconnect(run: Run, request: Request) -> list[tuple[int, Output]]:
    agen = run.outputs

    async def collect():
        return [p async for p in agen]

    task = asyncio.ensure_future(collect())
    try:
        await _watch_disconnect(task, request)
        return task.result()
    except asyncio.CancelledError:
        raise RouterError("CANCELLED", "client disconnected") from None
    finally:
        await agen.aclose()


async def _sse(run: Run, first: tuple[int, Output], shape, include_usage):
    """Server-sent events: per choice a start chunk, a chunk per Output and a finish chunk;
    then an optional usage chunk (all choices), `[DONE]`. A failure after output is an
    `{"error": ...}` event. The run ends when the stream does: "ok", the error's code, or
    CANCELLED (the client went away first)."""
    agen = run.outputs
    started: set[int] = set()
    last: list[Output] = []
    outcome, why = "CANCELLED", "the stream ended early"
    try:
        index, output = first
        while True:
            if index not in started:
                started.add(index)
                yield shape.start(index, output)
            # NOTE: an empty piece (a reasoning split holding a marker's first characters)
            # is not sent: an empty body part must never reach the transport
            if (output.text or output.token_ids) and (piece := shape.output(index, output)):
                yield piece
            if output.finished:
                last.append(output)
                yield shape.finish(index, output)
            try:
                index, output = await agen.__anext__()
            except StopAsyncIteration:
                break
        if include_usage and last:
            yield shape.usage(last)
        outcome = "ok"
    except RouterError as err:
        outcome, why = err.code, err.message
        yield f"data: {json.dumps(openai_body(err))}\n\n".encode()
    finally:
        # NOTE: ended first: under a cancelled scope any await below raises at once.
        run.end(outcome, why)
        await _close_quietly(run)
    yield b"data: [DONE]\n\n"


async def _close_quietly(run: Run) -> None:
    try:
        await run.aclose()
    except (Exception, asyncio.CancelledError):
        pass
