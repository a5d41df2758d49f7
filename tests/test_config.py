"""Service configs: validated at start with one clear line; --help documents every field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.config import parse_settings
from tandem.services.encoder.config import EncoderConfig
from tandem.services.language.config import LanguageConfig
from tandem.services.router.config import RouterConfig

TANDEM = [sys.executable, "-m", "tandem.cli"]
CONFIGS = {"encoder": EncoderConfig, "language": LanguageConfig, "router": RouterConfig}


def _run(args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    full_env.update(env or {})
    return subprocess.run(TANDEM + args, capture_output=True, text=True, env=full_env, timeout=60)


@pytest.mark.parametrize(
    "args,env,field",
    [
        (["encoder", "--model", "m", "--port", "-1"], {}, "port"),
        (["language", "--model", "m"], {"TANDEM_PORT": "70000"}, "port"),
        (["router", "--http-port", "0"], {}, "http_port"),
        (["encoder", "--model", "m", "--transfer.protocol", "udp"], {}, "transfer.protocol"),
        (["language", "--model", "m", "--kv-memory-fraction", "2"], {}, "kv_memory_fraction"),
    ],
)
def test_bad_value_stops_with_one_line_naming_field(args, env, field):
    r = _run(args, env)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert f"invalid config: {field}=" in lines[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_help_documents_every_field(name):
    r = _run([name, "--help"])
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    cls = CONFIGS[name]
    for fname, info in cls.model_fields.items():
        assert info.description, f"{name}.{fname} has no description"
        if fname != "transfer":
            assert "--" + fname.replace("_", "-") in text
        assert " ".join(info.description.split())[:30] in text


def test_env_and_flags_and_nested():
    os.environ["TANDEM_TRANSFER__PROTOCOL"] = "rdma"
    try:
        cfg = parse_settings(EncoderConfig, ["--model", "m", "--port", "1234"], "t")
    finally:
        del os.environ["TANDEM_TRANSFER__PROTOCOL"]
    assert cfg.port == 1234 and cfg.transfer.protocol == "rdma"
    r = parse_settings(RouterConfig, ["--encoders", "a:1,b:2"], "t")
    assert r.encoders == ["a:1", "b:2"]


def test_transfer_port_range_stays_where_mooncake_honours_it():
    """Mooncake ignores RPC port ranges past 32767 (listening anywhere in 15000-17000)."""
    r = _run(["encoder", "--model", "m", "--transfer.max-port", "40000"])
    assert r.returncode == 2 and "transfer.max_port='40000'" in r.stderr


def test_log_format_json_puts_every_line_in_json_with_a_level():
    """`--log-format json`: each stderr line is one JSON object with its level, the
    start-up error included (one line)."""
    import json

    r = _run(["encoder", "--model", "/nonexistent", "--insecure-internal", "--log-format", "json"])
    assert r.returncode == 2
    lines = [json.loads(ln) for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(e) for e in lines), r.stderr
    assert lines[-1]["level"] == "ERROR" and "no such checkpoint" in lines[-1]["msg"]
    assert any(e["level"] == "WARNING" and "PLAINTEXT" in e["msg"] for e in lines)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_unknown_tandem_variable_stops_the_service_with_one_line(name):
    """A misspelt TANDEM_* variable (or another service's) is refused, not ignored."""
    r = _run([name, "--model", "m"], {"TANDEM_CACHE_BYTE": "1", "TANDEM_BENCH_RUNS": "3"})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown environment variable(s) TANDEM_CACHE_BYTE" in lines[0]
    assert "TANDEM_BENCH_RUNS" not in lines[0]  # a benchmark's knob, not config


def test_the_kernels_own_variables_are_not_taken_for_config():
    """TANDEM_KERNEL_ISA (the vector path the CPU kernels build) and TANDEM_KERNEL_DIR (their
    build cache) are the kernels' documented knobs: a service started with them set must
    not refuse them as unknown config (a forced AVX2 build could start no tier)."""
    from tandem import cpu_kernels
    from tandem.config import NOT_CONFIG_ENV

    assert cpu_kernels.ISA_ENV in NOT_CONFIG_ENV and "TANDEM_KERNEL_DIR" in NOT_CONFIG_ENV
    r = _run(["encoder", "--model", "m"], {cpu_kernels.ISA_ENV: "native"})
    assert "unknown environment variable" not in r.stderr, r.stderr
