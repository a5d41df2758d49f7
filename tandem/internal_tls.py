"""mTLS between the tiers: who may call which method of the encoder and language tiers.

One CA signs a certificate per tier (tandem/pki.py); a certificate's subject common name
is its holder's role: router, encoder, language, operator (tooling: health and load).
Every encoder and language gRPC port requires a client certificate signed by that CA
(without one the TLS handshake fails: the caller sees UNAVAILABLE and no handler runs),
and each method admits only the roles that call it, checked before its handler runs
(PERMISSION_DENIED); POLICY below is the one table. So the language tier takes `Generate`
(and with it an encoder address to send its buffer layout to) only from the router, and
`Attach` data comes only from encoders, for rooms the language side itself opened.
Clients check a server against the CA and INTERNAL_NAME, which every tier certificate
carries, so certificates need not list pod addresses.

Plaintext between tiers only with `--insecure-internal` (a warning at start). The router's
public ports are not internal: they have their own TLS and API key (services/router).

    tls = load_internal_tls(cfg, "tandem language", role="language")   # None: plaintext
    server = grpc_server(tls)            # tandem/serving.py: the RoleGate when tls is set
    channel = aio_channel(address, tls)  # a client of another tier
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.config import InternalTLSConfig
from tandem.pki import INTERNAL_NAME, ROLES, common_name

log = logging.getLogger("tandem.tls")

ANY_ROLE = frozenset(ROLES)
# Method (or "/service/" prefix) -> the roles that may call it. The most specific entry
# wins; a method of a service not listed here is refused.
POLICY: dict[str, frozenset[str]] = {
    "/tandem.v1.Language/": frozenset({"router"}),
    "/tandem.v1.Language/GetLoad": frozenset({"router", "operator"}),
    # E/P/D: a decode instance has a prefill instance run a prompt (a language instance
    # serving `both` refuses it: only `--role prefill` serves it)
    "/tandem.v1.Language/Prefill": frozenset({"language"}),
    "/tandem.v1.Encoder/": frozenset({"router"}),
    "/tandem.v1.Encoder/GetLoad": frozenset({"router", "operator"}),
    "/tandem.v1.Encoder/Attach": frozenset({"language"}),
    "/tandem.v1.Encoder/EncodeRange": frozenset({"encoder"}),  # a lead's split prompt
    "/grpc.health.v1.Health/": ANY_ROLE,
    "/grpc.reflection.v1alpha.ServerReflection/": ANY_ROLE,
    "/grpc.reflection.v1.ServerReflection/": ANY_ROLE,
}


def allowed_roles(method: str) -> frozenset[str]:
    if method in POLICY:
        return POLICY[method]
    return POLICY.get(method[: method.rfind("/") + 1], frozenset())


def _pem(value: str, what: str, prog: str) -> bytes:
    if value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    try:
        return Path(value).read_bytes()
    except OSError as e:
        raise SystemExit(f"{prog}: cannot read internal TLS {what} {value!r}: "
                         f"{e.strerror}") from None


@dataclass(frozen=True)
class InternalTLS:
    ca: bytes
    cert: bytes
    key: bytes
    role: str

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def from_files(ca, cert, key, role: str) -> InternalTLS:
    """Material read from PEM files (tooling: `tandem up`'s probes as the operator)."""
    return InternalTLS(Path(ca).read_bytes(), Path(cert).read_bytes(), Path(key).read_bytes(),
                       role)


def load_internal_tls(cfg, prog: str, role: str) -> InternalTLS | None:
    """This process's mTLS material from its settings (`internal_tls`, `insecure_internal`),
    or None for plaintext; exits with one line when neither or both are configured, or
    when the certificate is not `role`'s."""
    t: InternalTLSConfig = cfg.internal_tls
    given = [v for v in (t.ca, t.cert, t.key) if v]
    if cfg.insecure_internal:
        if given:
            raise SystemExit(f"{prog}: --insecure-internal and --internal-tls.* both given; "
                             f"choose one")
        log.warning("%s: internal traffic is PLAINTEXT (--insecure-internal): any process "
                    "that reaches its ports can call every method", prog)
        return None
    if len(given) != 3:
        raise SystemExit(
            f"{prog}: internal TLS is not configured: give --internal-tls.ca, "
            f"--internal-tls.cert and --internal-tls.key (TANDEM_INTERNAL_TLS__CA/__CERT/"
            f"__KEY; `tandem certs DIR` makes them), or --insecure-internal for plaintext")
    tls = InternalTLS(_pem(t.ca, "CA", prog), _pem(t.cert, "certificate", prog),
                      _pem(t.key, "key", prog), role)
    try:
        got = common_name(tls.cert)
    except ValueError as e:
        raise SystemExit(f"{prog}: internal TLS certificate is not a PEM certificate: {e}"
                         ) from None
    if got != role:
        raise SystemExit(f"{prog}: internal TLS certificate is for role {got!r}, not {role!r}")
    return tls


def _options(tls: InternalTLS | None, options) -> list:
    return [*options, ("grpc.ssl_target_name_override", INTERNAL_NAME)] if tls else list(options)


def aio_channel(address: str, tls: InternalTLS | None, options=()) -> grpc.aio.Channel:
    """A client channel to another tier: mTLS with this process's certificate, or plain."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), _options(tls, options))


def sync_channel(address: str, tls: InternalTLS | None, options=()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), _options(tls, options))


def peer_role(context) -> str:
    """The caller's role: its verified certificate's common name ("" without one)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else ""


class RoleGate(grpc.aio.ServerInterceptor):
    """Every handler first checks the caller's role against POLICY."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _guarded(handler, details.method, allowed_roles(details.method))


async def _check(context, method: str, roles: frozenset[str]) -> None:
    role = peer_role(context)
    if role not in roles:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{method} is not for {role or 'an unauthenticated caller'}")


def _guard(fn, method: str, roles: frozenset[str]):
    if inspect.isasyncgenfunction(fn):
        async def gen(request, context):
            await _check(context, method, roles)
            async for item in fn(request, context):
                yield item
        return gen

    async def call(request, context):
        await _check(context, method, roles)
        out = fn(request, context)
        return await out if inspect.isawaitable(out) else out
    return call


def _guarded(h: grpc.RpcMethodHandler, method: str, roles: frozenset[str]):
    io = dict(request_deserializer=h.request_deserializer,
              response_serializer=h.response_serializer)
    if h.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_guard(h.unary_unary, method, roles), **io)
    if h.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_guard(h.unary_stream, method, roles), **io)
    if h.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_guard(h.stream_unary, method, roles), **io)
    return grpc.stream_stream_rpc_method_handler(_guard(h.stream_stream, method, roles), **io)
