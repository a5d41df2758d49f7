"""Settings plumbing shared by every service: CLI flags + TANDEM_* environment variables.

Each service declares one pydantic-settings model (fields documented with `description`,
ranges with `ge`/`le`), and `parse_settings` turns argv + environment into a validated
instance, or exits with one line naming the bad field.
"""

from __future__ import annotations

import os
import sys
from typing import Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict

from tandem.tracing import TracingConfig

S = TypeVar("S", bound=BaseSettings)


class TandemSettings(BaseSettings):
    """Base of every service config: `TANDEM_<FIELD>` env vars, `--field` CLI flags,
    nested models as `--transfer.protocol` / `TANDEM_TRANSFER__PROTOCOL`."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_",
        env_nested_delimiter="__",
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        validate_default=True,
    )


class TransferConfig(BaseModel):
    """Mooncake transfer engine settings (shared by encoder and language)."""

    protocol: str = Field(
        "tcp", pattern="^(tcp|rdma)$", description="Transfer protocol: tcp (any host) or rdma."
    )
    device_name: str = Field(
        "", description="RDMA device names (e.g. 'mlx5_0,mlx5_1'); empty for tcp."
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        description="Mooncake metadata server URL, or P2PHANDSHAKE for peer-to-peer handshakes.",
    )
    host: str = Field(
        "127.0.0.1", description="Host/IP this instance's transfer engine is reachable at."
    )
    # NOTE: Mooncake silently ignores an RPC port range that reaches past 32767 and then
    # listens anywhere in 15000-17000 (measured with 0.3.13), so the bound is enforced here.
    min_port: int = Field(15000, ge=1024, le=32767, description="Lowest transfer RPC port.")
    max_port: int = Field(
        15999, ge=1024, le=32767,
        description="Highest transfer RPC port (<= 32767: Mooncake ignores higher ranges).",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=600, description="Room timeout: max seconds without Init or data."
    )
    protect: Literal["none", "mac", "encrypt"] = Field(
        "mac",
        description="Protection of the rows on the data plane, which any process reaching "
        "the transfer ports can read and write. 'mac': each written range carries Poly1305 "
        "tags under a per-room key sent on the authenticated Attach stream; the language "
        "side verifies its private copy before a prefill (a tampered or foreign write fails "
        "the room with DATA_LOSS). 'encrypt': mac, and the rows travel and land "
        "ChaCha20-encrypted (unreadable in flight). 'none': the aux fence only. The language "
        "side asks for its setting; an encoder refuses a room that asks for less than its "
        "own (FAILED_PRECONDITION).",
    )
    stream: bool = Field(
        False,
        description="Streamed rows (docs/architecture.md, 'Streamed rows'; off by default: on one host "
        "whose cores both tiers share it bought no TTFT, docs/benchmarks.md). Encoder: send a prompt's rows "
        "in order as they become final (the text at once, each image's as soon as its ViT "
        "features exist; a request's images then go through the ViT one at a time). "
        "Language: hand a prompt to the engine at its first rows and prefill what has "
        "arrived while the rest is on its way (the first token still comes after the whole "
        "prompt). Either side may be off: the other then falls back to the whole prompt.",
    )

    @property
    def heartbeat_s(self) -> float:
        """How often a side that works without sending anything else says so (AttachWorking
        on the Attach stream, a helper's on its EncodeRange): a third of the timeout, so
        one late beat never looks like a stall."""
        return max(0.5, self.timeout_s / 3)


class InternalTLSConfig(BaseModel):
    """PEM files (or the PEM text itself, for secrets passed through the environment)."""

    ca: str = Field("", description="The CA that signs every tier's certificate (mTLS "
                    "between tiers); `tandem certs DIR` makes one.")
    cert: str = Field("", description="This process's certificate; its common name is its "
                      "role (router, encoder, language).")
    key: str = Field("", description="This process's private key.")


class ServiceSettings(TandemSettings):
    """The fields every service has: its model, where it binds, how long a request without
    a deadline may run, how long SIGTERM waits. A service with other defaults or another
    meaning redeclares the field (it keeps its place in --help)."""

    model: str = Field(..., description="Checkpoint: a local directory or a Hugging Face id.")
    host: str = Field("127.0.0.1", description="Address the service's servers bind to.")
    request_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="Default deadline of a request without one."
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="On SIGTERM, wait this long for requests in progress."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text or as one JSON object per line (each with "
        "its level).")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="The least severe level logged (library loggers included); "
        "'warning' hides the per-request lines.")
    internal_tls: InternalTLSConfig = Field(
        default_factory=InternalTLSConfig,
        description="mTLS between tiers (tandem/internal_tls.py); required unless "
        "--insecure-internal.")
    insecure_internal: bool = Field(
        False, description="Plaintext between tiers, no mTLS: any process that reaches the "
        "tiers' ports can call them. Only for a network nothing else reaches; logs a warning.")
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces over OTLP/gRPC (tandem/tracing.py); off unless an "
        "endpoint is set here or in OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT.")


class ModelServiceSettings(ServiceSettings):
    """A tier that loads a checkpoint onto a device and moves prompts through Mooncake
    (encoder, language). Each declares its own `port` (the defaults differ)."""

    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus metrics HTTP port; 0 disables it."
    )
    device: str = Field("auto", description="'auto' (cuda if available), 'cpu' or 'cuda[:N]'.")
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|bfloat16|float16)$",
        description="Model dtype; 'auto' is bfloat16 on CUDA and float32 on CPU.",
    )
    transfer: TransferConfig = Field(
        default_factory=TransferConfig, description="Transfer engine settings."
    )
    health_port: int = Field(
        0, ge=0, le=65535, description="Also serve grpc.health.v1 alone, plaintext, on this "
        "port (Kubernetes probes cannot present the internal client certificate); 0: off.")
    chat_template: str = Field(
        "", description="The chat template every chat is rendered with, as vLLM's "
        "--chat-template: a file's path or the template itself; empty = the checkpoint's. "
        "Give the encoder and the language tier the same one.")

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str) -> str:
        from tandem.chat import load_chat_template

        load_chat_template(value)  # a missing file stops the process here, by name
        return value


def format_validation_error(prog: str, err: ValidationError) -> str:
    """One line per bad field: `prog: invalid config: port=-1: Input should be >= 1`."""
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        value = e.get("input")
        shown = f"={value!r}" if not isinstance(value, dict) else ""
        parts.append(f"{field}{shown}: {e['msg']}")
    return f"{prog}: invalid config: " + "; ".join(parts)


# TANDEM_* variables that are not service config (the launcher's, the kernels' build
# cache, a tensor-parallel worker's secret, benchmarks' and tests' knobs).
NOT_CONFIG_ENV = ("TANDEM_CACHE_DIR", "TANDEM_KERNEL_DIR", "TANDEM_TP_AUTHKEY",
                  "TANDEM_KERNEL_ISA",  # cpu_kernels.ISA_ENV: the vector path to build
                  "TANDEM_NATIVE_LOG_FILTERED",  # launch/procs.py FILTERED_ENV
                  "TANDEM_PORT_RANGE",  # launch/procs.py PORT_RANGE_ENV (tandem up --port-range)
                  # launch/procs.py port_window: a launcher's share of the port windows
                  "TANDEM_SERVICE_PORTS", "TANDEM_MOONCAKE_PORTS")
# TANDEM_TEST_DEVICE: the device the exactness tests run on (tests/language_oracle.py)
NOT_CONFIG_ENV_PREFIXES = ("TANDEM_BENCH_", "TANDEM_SOAK_", "TANDEM_TEST_")


def env_names(cls: type[BaseSettings]) -> set[str]:
    """Every TANDEM_* variable `cls` reads: a field, or a nested model's field."""
    names = set()
    for name, f in cls.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names |= {f"TANDEM_{name}__{sub}".upper() for sub in ann.model_fields}
        else:
            names.add(f"TANDEM_{name}".upper())
    return names


def unknown_env(cls: type[BaseSettings], environ) -> list[str]:
    """TANDEM_* variables in `environ` that `cls` does not read: a typo (`cache_byte`) or
    another service's setting would otherwise be ignored without a word."""
    known = env_names(cls)
    return sorted(k for k in environ if k.upper().startswith("TANDEM_")
                  and k.upper() not in known and k.upper() not in NOT_CONFIG_ENV
                  and not k.upper().startswith(NOT_CONFIG_ENV_PREFIXES))


def parse_settings(cls: type[S], argv: list[str], prog: str) -> S:
    """Build `cls` from argv and the environment; exit(2) with one clear line if invalid
    (a bad value, an unknown flag, or a TANDEM_* variable that is not one of its fields)."""
    unknown = unknown_env(cls, os.environ)
    if unknown:
        print(f"{prog}: invalid config: unknown environment variable(s) {', '.join(unknown)}: "
              f"not settings of this service (`{prog} --help` lists them)", file=sys.stderr)
        raise SystemExit(2)
    try:
        source = CliSettingsSource(cls, cli_prog_name=prog)
        return CliApp.run(cls, cli_args=argv, cli_settings_source=source)
    except ValidationError as err:
        print(format_validation_error(prog, err), file=sys.stderr)
        raise SystemExit(2) from None
