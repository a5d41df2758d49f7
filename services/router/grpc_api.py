"""gRPC `Router` front-end (the SDK's endpoint): same semantics as the HTTP API.

Errors before any output end the call with a status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAUTHENTICATED, UNAVAILABLE, DEADLINE_EXCEEDED, ...); a failure after output is a last
message with finish_reason ERROR and `error` set. A client that cancels the call cancels
this handler's task, which closes the dispatcher's generator (see dispatch/dispatcher.py's leak note).
"""

from __future__ import annotations

import dataclasses
import uuid

import grpc
from pydantic import TypeAdapter, ValidationError

from tandem import sampling, tracing
from tandem.chat import ChatError, template_options_from_proto
from tandem.errors import FIELD_METADATA
from tandem.services.router.admission import client_id
from tandem.services.router.choices import choice_requests, merged
from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.errors import RouterError
from tandem.services.router.openai.chat import Tool, tool_setup_of
from tandem.services.router.refusals import HeldTooLong, Ticket
from tandem.services.router.request import MAX_TIMEOUT_MS, ChatRequest, Output
from tandem.services.router.tenants import cache_namespace
from tandem.services.router.tools import ToolMode, ToolSetup, parse_output
from tandem.v1 import common_pb2, language_pb2, router_pb2, router_pb2_grpc

_TOOLS = TypeAdapter(list[Tool])


def _validate(request: router_pb2.RouterGenerateRequest, cfg: RouterConfig) -> ChatRequest:
    if not request.messages:
        raise RouterError("INVALID_ARGUMENT", "messages must not be empty", "messages")
    s = request.sampling
    if not 0 <= request.timeout_ms <= MAX_TIMEOUT_MS:
        raise RouterError("INVALID_ARGUMENT", f"timeout_ms must be in [0, {MAX_TIMEOUT_MS}] "
                          "(0 = the router's default)", "timeout_ms")  # fmt: skip
    if not 0 <= request.n <= 16:
        raise RouterError("INVALID_ARGUMENT", "n must be in [1, 16]", "n")
    for i, m in enumerate(request.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise RouterError("INVALID_ARGUMENT", f"unknown role {m.role!r}", f"messages[{i}].role")
        for j, part in enumerate(m.content):
            if part.WhichOneof("part") == "image" and len(part.image.data) > cfg.max_image_bytes:
                raise RouterError(
                    "TOO_LARGE",
                    f"image larger than {cfg.max_image_bytes} bytes",
                    f"messages[{i}].content[{j}].image",
                )
            if part.WhichOneof("part") == "video" and len(part.video.data) > cfg.max_video_bytes:
                raise RouterError("TOO_LARGE", f"video larger than {cfg.max_video_bytes} bytes "
                                  "(the router's max_video_bytes)",
                                  f"messages[{i}].content[{j}].video")  # fmt: skip
            if part.WhichOneof("part") == "video" and sum(
                    len(f.data) for f in part.video.frames.frames) > cfg.max_video_bytes:
                raise RouterError("TOO_LARGE", f"the frames are larger than {cfg.max_video_bytes}"
                                  " bytes together (the router's max_video_bytes)",
                                  f"messages[{i}].content[{j}].video.frames")  # fmt: skip
    tools = _tools(request)
    if tools.grammar is not None:
        if s.HasField("structured_output"):
            raise RouterError("INVALID_ARGUMENT", "a forced tool call and another output "
                              "constraint cannot go together", "tool_choice")  # fmt: skip
        s = common_pb2.SamplingParams()
        s.CopyFrom(request.sampling)
        s.structured_output.CopyFrom(tools.grammar)
    try:
        sampling.from_proto(s)  # the language tier's own check, before routing
    except sampling.SamplingError as e:
        raise RouterError("INVALID_ARGUMENT", str(e), f"sampling.{e.field}") from None
    try:  # the tiers' own check of the template options, before routing
        template_options_from_proto(request.template_options)
    except ChatError as e:
        raise RouterError("INVALID_ARGUMENT", e.detail, e.field) from None
    return ChatRequest(
        messages=list(request.messages),
        sampling=s,
        tools=tools,
        timeout_s=request.timeout_ms / 1000 if request.timeout_ms else cfg.request_timeout_s,
        request_id=request.request_id or f"req-{uuid.uuid4().hex[:24]}",
        priority=request.priority,
        template_options=request.template_options,
    )


def _tools(request: router_pb2.RouterGenerateRequest) -> ToolSetup:
    """The request's tools_json / tool_choice, validated as the HTTP API validates them."""
    tools = None
    if request.tools_json:
        try:
            tools = _TOOLS.validate_json(request.tools_json)
        except ValidationError as e:
            raise RouterError("INVALID_ARGUMENT", f"tools: {e.errors()[0]['msg']}",
                              "tools") from None  # fmt: skip
    return tool_setup_of(tools, request.tool_choice or None)


def _field_metadata(err: RouterError) -> tuple[tuple[str, str], ...]:
    """The offending input's name as trailing metadata of a failed call (the SDK reads it
    into TandemError.field; a status carries only a code and a message)."""
    return ((FIELD_METADATA, err.param),) if err.param else ()


def _client_id(context: grpc.aio.ServicerContext, cfg: RouterConfig) -> str:
    """The caller's key (admission.client_id) from its peer, "ipv4:1.2.3.4:port" or
    "ipv6:[::1]:port", or the configured metadata key."""
    forwarded = None
    if cfg.client_id_header:
        forwarded = dict(context.invocation_metadata() or ()).get(cfg.client_id_header.lower())
    peer = context.peer() or ""
    host = peer.partition(":")[2].rpartition(":")[0].strip("[]") if ":" in peer else peer
    return client_id(host or peer, forwarded)


def _whole(outputs: list[Output], tools: ToolSetup) -> Output:
    """A request with tools, answered in one last Output: its content and its calls (then
    its finish reason is TOOL_CALLS), all its tokens and logprobs."""
    out = parse_output("".join(o.text for o in outputs), tools)
    last = outputs[-1]
    response = language_pb2.LanguageGenerateResponse(
        text=out.content or "", finish_reason=last.response.finish_reason,
        token_ids=[t for o in outputs for t in o.token_ids],
        logprobs=[lp for o in outputs for lp in o.logprobs])
    return dataclasses.replace(last, response=response, tool_calls=out.tool_calls)


def _to_proto(output: Output, request_id: str, index: int = 0) -> router_pb2.RouterGenerateResponse:
    out = router_pb2.RouterGenerateResponse(
        text=output.text, token_ids=output.token_ids, logprobs=output.logprobs,
        tool_calls=output.tool_calls, request_id=request_id, index=index,
    )
    if output.finished:
        out.finish_reason = output.finish_reason
        u = output.usage
        out.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                total_tokens=u.total_tokens,
                cached_image_tokens=u.cached_image_tokens,
                cached_tokens=u.cached_tokens,
            )
        )
        if output.timings is not None:
            out.timings.CopyFrom(output.timings)
    return out


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    def _auth(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant (UNAUTHENTICATED without a valid key where keys are set)."""
        md = dict(context.invocation_metadata() or ())
        return self.core.tenants.authenticate(md.get("authorization"))

    async def Generate(self, request, context):
        core = self.core
        who = _client_id(context, core.cfg)
        try:
            ticket = await core.refusals.enter(who)  # refusals.py: a client in debt waits
        except HeldTooLong as held:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(held))
        try:
            async for out in self._generate(request, context, who, ticket):
                yield out
        finally:
            ticket.close()

    async def _generate(self, request, context, who: str, ticket: Ticket):
        """Generate's body; the first message or the error goes to the refusal `ticket`."""
        core = self.core
        sent = False
        request_id = request.request_id
        root = tracing.OFF  # the request's root span once it is valid
        try:
            tenant = self._auth(context)
            core.check_model(request.model)
            req = _validate(request, core.cfg)
            req.client_id, req.tenant = who, tenant
            req.cache_salt = cache_namespace(tenant, request.cache_salt)
            request_id = req.request_id
            n = request.n or 1
            if n > 1 and req.tools.mode is not ToolMode.NONE:
                raise RouterError("INVALID_ARGUMENT", "n > 1 with tools is not served", "n")
            req.trace = root = core.start_trace(req, "grpc", tracing.from_call(context), True, n)
            release = core.admit(req.tenant, root)
            try:
                agen = merged([core.dispatcher.generate(r) for r in choice_requests(req, n)])
                try:
                    if req.tools.mode is not ToolMode.NONE:  # calls known at the end only
                        whole = _whole([o async for _, o in agen], req.tools)
                        sent = True
                        ticket.close()
                        yield _to_proto(whole, request_id)
                    async for index, output in agen:
                        sent = True
                        ticket.close()
                        yield _to_proto(output, request_id, index)
                finally:
                    await agen.aclose()
            finally:
                release()
            core.metrics.requests.labels("grpc", "ok").inc()
            root.end()
        except RouterError as err:
            core.metrics.requests.labels("grpc", err.code.lower()).inc()
            tracing.fail(root, err.code, err.message)
            tracing.end(root)
            if not sent:
                ticket.answered(err.http_status, request.ByteSize())
                await context.abort(err.grpc_code, err.message, _field_metadata(err))
            yield router_pb2.RouterGenerateResponse(
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorInfo(
                    code=err.grpc_name, message=err.message, field=err.param or ""
                ),
                request_id=request_id,
            )
        except BaseException:  # the caller went away (its call cancelled)
            tracing.fail(root, "CANCELLED")
            tracing.end(root)
            raise

    async def ListModels(self, request, context):
        try:
            self._auth(context)
        except RouterError as err:
            await context.abort(err.grpc_code, err.message)
        name = self.core.model_name()
        return router_pb2.ListModelsResponse(
            models=[router_pb2.ModelInfo(id=name, source=self.core.cfg.model or name)]
        )
