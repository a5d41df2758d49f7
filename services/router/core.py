"""The router's core, under both doors (HTTP: openai/, gRPC: grpc_api.py): its shared
state, and `generate`, the one way a generation request is run. A door translates its wire
format into a `Query` and says who called (`Caller`); the core checks the request-level
bounds (bounds.py), makes the request's cache namespace, traces it, admits it and fans its
`n` choices out through the dispatcher (choices.py), and hands back a `Run` whose Outputs
the door translates back into its wire format."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import PurePath

import grpc

from tandem import tracing
from tandem.metrics import metric_set, service_registry
from tandem.services.router import bounds
from tandem.services.router.admission import Admission
from tandem.services.router.choices import choice_requests, merged
from tandem.services.router.config import RouterConfig
from tandem.services.router.dispatch.dispatcher import Dispatcher
from tandem.services.router.dispatch.registry import Registry
from tandem.services.router.dispatch.selection import Selector
from tandem.services.router.errors import RouterError, Tier, internal_call_error
from tandem.services.router.health import Health, TierHealth
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.refusals import RefusalBudget
from tandem.services.router.request import (
    Caller,
    ChatRequest,
    Door,
    Output,
    Query,
    image_hashes,
)
from tandem.services.router.tenants import Tenants, cache_namespace
from tandem.services.router.tools import ToolMode
from tandem.v1 import language_pb2


class RouterCore:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = metric_set(RouterMetrics, service_registry())
        self.registry = Registry(cfg)
        # NOTE: one selector per tier: a shared round-robin counter would advance twice per
        # request and pin every request of one tier to the same instance.
        self.selectors = {
            kind: Selector(cfg.policy, cfg.affinity_slack)
            for kind in ("encoder", "language", "prefill")
        }
        self.dispatcher = Dispatcher(self.registry, self.selectors, cfg, self.metrics)
        self.tenants = Tenants(cfg.api_key, cfg.api_keys_file)
        self.admission = Admission(cfg.max_inflight, self.metrics, self.tenants)
        self.refusals = RefusalBudget(
            cfg.refusal_bytes_per_s, cfg.refusal_burst_bytes, cfg.refusal_max_hold_s,
            on_hold=lambda outcome: self.metrics.refusal_holds.labels(outcome).inc())
        self.draining = False
        self.started = int(time.time())  # /v1/models' `created`
        self._max_model_len = 0  # the language tier's, once one instance said it (0: not yet)

    def model_root(self) -> str:
        """The checkpoint the tiers loaded (a path or hub id, as they report it in
        GetLoad), vLLM's `root` of every served name; the model's name until one reported."""
        for pool in (self.registry.languages, self.registry.encoders):
            for inst in list(pool.instances.values()):
                if inst.model:
                    return inst.model
        return self.model_name()

    async def max_model_len(self) -> int | None:
        """The language tier's max_model_len (prompt + output), asked of a healthy instance
        once (a one-character Tokenize answers it; an empty prompt is refused) and kept;
        None while no instance can say."""
        if not self._max_model_len:
            try:
                resp = await self.language_call(
                    "Tokenize", language_pb2.TokenizeRequest(prompt="a"), timeout_s=2.0)
            except RouterError:
                return None
            self._max_model_len = resp.max_model_len
        return self._max_model_len or None

    def model_name(self) -> str:
        return self.registry.model_name() or "tandem"

    def served_names(self) -> list[str]:
        """The model's name, then its aliases (--model-aliases), each once."""
        return list(dict.fromkeys([self.model_name(), *self.cfg.model_aliases]))

    def check_model(self, name: str) -> None:
        """Empty means the served model; so does any of its names, or a path or id that
        ends in one (a client that names the checkpoint's path or hub id)."""
        if name and not any(served in (name, PurePath(name).name)
                            or name == PurePath(served).name for served in self.served_names()):
            raise RouterError("NOT_FOUND", f"model {name!r} is not served here", "model")

    def health(self) -> Health:
        """What the router can serve now (health.py): each tier's healthy and known
        instances, and whether it drains."""
        pools = self.registry.encoders, self.registry.languages, self.registry.prefills
        enc, lang, pre = (TierHealth(p.healthy_count(), len(p.instances)) for p in pools)
        return Health(encoder=enc, language=lang, draining=self.draining,
                      prefill=pre if self.registry.disaggregated else None)

    def ready(self) -> bool:
        """Every tier serving (health.Health.serves_all): gRPC's "tandem.v1.Router"."""
        return self.health().serves_all

    def refresh_gauges(self) -> None:
        self.metrics.healthy.labels("encoder").set(self.registry.encoders.healthy_count())
        self.metrics.healthy.labels("language").set(self.registry.languages.healthy_count())
        if self.registry.disaggregated:
            self.metrics.healthy.labels("prefill").set(self.registry.prefills.healthy_count())
        self.metrics.serving(self.model_name())
        # vLLM's names for the language tier's load: its healthy instances' last GetLoad
        up = [i for i in list(self.registry.languages.instances.values()) if i.tracker.healthy]
        self.metrics.vllm.tier(self.model_name(), sum(i.running for i in up),
                               sum(i.waiting for i in up),
                               sum(i.kv_used for i in up) / len(up) if up else 0.0)

    async def language_call(self, method: str, msg, timeout_s: float = 10.0):
        """A unary call (Tokenize, Detokenize) on the least-loaded healthy language
        instance; its failure as a RouterError (INVALID_ARGUMENT stays a 400)."""
        lang = self.dispatcher.pick_language()
        try:
            return await getattr(lang.stub, method)(msg, timeout=timeout_s)
        except grpc.RpcError as e:  # its own timeout passing: the instance is stuck (503)
            raise internal_call_error(e, Tier.LANGUAGE, lang.address, math.inf) from None

    def generate(self, query: Query, caller: Caller) -> Run:
        """Run `query` for `caller`, the one way either door does: its request-level bounds
        checked (bounds.py), its cache namespace made of the caller's tenant and the salt it
        asked for, its root span started (a child of the caller's traceparent), admitted
        (`admit`), and its `n` choices started through the dispatcher. A refusal here is a
        RouterError, counted (and traced once the span exists); past it, the door owns the
        returned Run and ends it (Run.end) when its answer has ended."""
        try:
            bounds.check(query, self.cfg)
            salt = cache_namespace(caller.tenant, query.cache_salt)
        except RouterError as err:
            self.count(caller.door, err.code)
            raise
        root = self.start_trace(query, caller)
        try:
            release = self.admit(caller.tenant, root)
        except RouterError as err:
            self.count(caller.door, err.code)
            tracing.fail(root, err.code, err.message)
            root.end()
            raise
        timeout_s = (query.timeout_ms / 1000 if query.timeout_ms is not None
                     else self.cfg.request_timeout_s)
        req = ChatRequest(
            messages=query.messages, sampling=query.sampling, timeout_s=timeout_s,
            request_id=query.request_id, priority=query.priority, tools=query.tools,
            prompt=query.prompt, client_id=caller.client_id, tenant=caller.tenant,
            cache_salt=salt, template_options=query.template_options, trace=root)
        outputs = merged([self.dispatcher.generate(r) for r in choice_requests(req, query.n)])
        return Run(req, query.n, outputs, release, functools.partial(self.count, caller.door))

    def count(self, door: Door, outcome: str) -> None:
        """Count one generation request that reached a door's handler, once, when its
        answer has ended: "ok" or the error code it ended with (metrics.py)."""
        self.metrics.requests.labels(door.value, outcome.lower()).inc()

    def start_trace(self, query: Query, caller: Caller) -> tracing.Span:
        """The root span of `query` (OFF while tracing is off), a child of the caller's
        traceparent when it sent one; named and described by the OpenTelemetry GenAI
        conventions. Its Run ends it when the door's answer has ended."""
        if not tracing.enabled():
            return tracing.OFF
        op = "text_completion" if query.prompt else "chat"
        model, s = self.model_name(), query.sampling
        attrs = {tracing.REQUEST_ID: query.request_id, tracing.OPERATION: op,
                 tracing.REQUEST_MODEL: model, tracing.REQUEST_STREAM: query.stream,
                 tracing.REQUEST_CHOICES: query.n, tracing.REQUEST_TEMPERATURE: s.temperature,
                 "tandem.api": caller.door.value,
                 "tandem.images": len(image_hashes(query.messages))}
        for key, name in ((tracing.REQUEST_MAX_TOKENS, "max_tokens"),
                          (tracing.REQUEST_TOP_P, "top_p"), (tracing.REQUEST_SEED, "seed")):
            if s.HasField(name):
                attrs[key] = getattr(s, name)
        if s.top_k > 0:
            attrs[tracing.REQUEST_TOP_K] = s.top_k
        return tracing.start(f"{op} {model}", caller.trace_parent,
                             kind=tracing.SpanKind.SERVER, attributes=attrs)

    def admit(self, tenant: str = "", trace: tracing.Span = tracing.OFF) -> Callable[[], None]:
        """Admit one request of `tenant`, the only way either front end does: refused while
        draining (UNAVAILABLE) or at capacity, the router's or the tenant's (OVERLOADED);
        returns the request's release, which is idempotent so every exit path may call it.
        `trace`: the request's root span (a `router.admission` span under it)."""
        span = tracing.start("router.admission", trace, attributes={
            "tandem.tenant": tenant or "-", "tandem.router.inflight": self.admission.inflight})
        try:
            if self.draining:
                raise RouterError("UNAVAILABLE", "router is draining")
            self.admission.acquire(tenant)
        except RouterError as err:
            tracing.fail(span, err.code, err.message)
            raise
        finally:
            span.end()
        self.metrics.tenant_requests.labels(tenant or "-").inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admission.release(tenant)

        return release


class Run:
    """One admitted request on its way (RouterCore.generate): its choices' Outputs as
    (choice index, Output) in arrival order (`outputs`; choices.merged), and its end.

    `end` ends it once, whoever calls it first (every exit path of a door may): the
    admission slot released, the request counted by its outcome, its root span ended
    (failed unless "ok"). `aclose` closes the choices' streams (the dispatcher's
    generators; see dispatch/dispatcher.py's leak note)."""

    def __init__(self, request: ChatRequest, n: int,
                 outputs: AsyncGenerator[tuple[int, Output], None],
                 release: Callable[[], None], count: Callable[[str], None]) -> None:
        """`release`: the admission slot's (RouterCore.admit); `count`: counts the
        request by its outcome (RouterCore.count, for its door)."""
        self.request = request
        self.n = n
        # NOTE: a request with tools is answered whole (`whole_output`): a tool call is
        # known only once its closing tag is out (n > 1 with tools is refused: bounds.py)
        self.whole = request.tools.mode is not ToolMode.NONE
        self.outputs = outputs
        self._release, self._count = release, count
        self._ended = False

    async def whole_output(self) -> Output:
        """The one choice of a request with tools, whole: its content and its calls
        (Output.whole)."""
        return Output.whole([o async for _, o in self.outputs], self.request.tools)

    def end(self, outcome: str = "ok", message: str = "") -> None:
        """End the request: "ok", or the code it failed with (an error's code, CANCELLED
        when its caller left first) and why."""
        if self._ended:
            return
        self._ended = True
        self._release()
        self._count(outcome.lower())
        if outcome != "ok":
            tracing.fail(self.request.trace, outcome.upper(), message)
        tracing.end(self.request.trace)

    async def aclose(self) -> None:
        await self.outputs.aclose()
