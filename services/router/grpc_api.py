"""gRPC `Router` front-end (the SDK's endpoint): same semantics as the HTTP API. The door
translates only: a RouterGenerateRequest into a Query (`_validate`), its caller (peer,
credentials, traceparent) into a Caller, the core's Outputs into RouterGenerateResponses;
the rules of a request (bounds, admission, tools, tracing, choices) are the core's.

Errors before any output end the call with a status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAUTHENTICATED, UNAVAILABLE, DEADLINE_EXCEEDED, ...); a failure after output is a last
message with finish_reason ERROR and `error` set. A client that cancels the call cancels
this handler's task, which closes the dispatcher's generator (see dispatch/dispatcher.py's leak note).
"""

from __future__ import annotations

import uuid

import grpc

from tandem import sampling, tracing
from tandem.chat import ChatError, template_options_from_proto
from tandem.errors import FIELD_METADATA
from tandem.services.router.admission import client_id
from tandem.services.router.config import RouterConfig
from tandem.services.router.core import RouterCore
from tandem.services.router.errors import RouterError
from tandem.services.router.refusals import HeldTooLong, Ticket
from tandem.services.router.request import Caller, Door, Output, Query
from tandem.services.router.tools import forced, tool_setup_of, tools_from_json
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc


def _validate(request: router_pb2.RouterGenerateRequest) -> Query:
    """The wire's request as a Query, its input checked (its request-level bounds are the
    core's: bounds.py)."""
    if not request.messages:
        raise RouterError("INVALID_ARGUMENT", "messages must not be empty", "messages")
    for i, m in enumerate(request.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise RouterError("INVALID_ARGUMENT", f"unknown role {m.role!r}", f"messages[{i}].role")
    tools = tool_setup_of(tools_from_json(request.tools_json), request.tool_choice or None)
    s = request.sampling
    if tools.grammar is not None:
        s = common_pb2.SamplingParams()
        s.CopyFrom(request.sampling)
        asked = s.structured_output if s.HasField("structured_output") else None
        s.structured_output.CopyFrom(forced(tools.grammar, asked))
    try:
        sampling.from_proto(s)  # the language tier's own check, before routing
    except sampling.SamplingError as e:
        raise RouterError("INVALID_ARGUMENT", str(e), f"sampling.{e.field}") from None
    try:  # the tiers' own check of the template options, before routing
        template_options_from_proto(request.template_options)
    except ChatError as e:
        raise RouterError("INVALID_ARGUMENT", e.detail, e.field) from None
    return Query(
        messages=list(request.messages),
        sampling=s,
        request_id=request.request_id or f"req-{uuid.uuid4().hex[:24]}",
        timeout_ms=request.timeout_ms or None,  # the wire's 0: absent
        n=request.n or 1,  # the wire's 0: one
        stream=True,
        priority=request.priority,
        tools=tools,
        template_options=request.template_options,
        cache_salt=request.cache_salt,
    )


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
        """Generate's body: the wire's request translated, run by the core, its Outputs
        translated back; the first message or the error goes to the refusal `ticket`."""
        core = self.core
        try:
            caller = Caller(Door.GRPC, who, self._auth(context), tracing.from_call(context))
            core.check_model(request.model)
            query = _validate(request)
        except RouterError as err:  # refused by the door: counted here, as the core counts its own
            core.count(Door.GRPC, err.code)
            await self._abort(context, err, ticket, request)
        try:
            run = core.generate(query, caller)
        except RouterError as err:  # counted and traced by the core
            await self._abort(context, err, ticket, request)
        sent = False
        try:
            if run.whole:
                whole = await run.whole_output()
                sent = True
                ticket.close()
                yield _to_proto(whole, query.request_id)
            async for index, output in run.outputs:
                sent = True
                ticket.close()
                yield _to_proto(output, query.request_id, index)
            run.end()
        except RouterError as err:
            run.end(err.code, err.message)
            if not sent:
                await self._abort(context, err, ticket, request)
            yield router_pb2.RouterGenerateResponse(
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorInfo(
                    code=err.grpc_name, message=err.message, field=err.param or ""
                ),
                request_id=query.request_id,
            )
        except BaseException:  # the caller went away (its call cancelled)
            run.end("CANCELLED")
            raise
        finally:
            await run.aclose()

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, err: RouterError, ticket: Ticket,
                     request: router_pb2.RouterGenerateRequest) -> None:
        """End the call with `err`'s status, before any output (charged to the ticket)."""
        ticket.answered(err.http_status, request.ByteSize())
        await context.abort(err.grpc_code, err.message, _field_metadata(err))

    async def ListModels(self, request, context):
        try:
            self._auth(context)
        except RouterError as err:
            await context.abort(err.grpc_code, err.message)
        name = self.core.model_name()
        return router_pb2.ListModelsResponse(
            models=[router_pb2.ModelInfo(id=name, source=self.core.cfg.model or name)]
        )
