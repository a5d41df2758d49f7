"""A vLLM user's command line: `tandem serve MODEL [vLLM flags]` plans the cluster each flag
names (read back through every tier's own settings parser); every row of the flag table
(tandem/launch/vllm_flags.py) does what its fate says: a mapped flag changes the
configuration, an accepted one prints its notice and changes nothing, a refused one exits 2
with its reason; vLLM's value forms are parsed before anything starts; a bad checkpoint
stops the launch before anything starts, and `tandem --version` / `GET /version` say what
runs."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import tandem
from tandem.config import parse_settings
from tandem.launch import serve, vllm_flags
from tandem.launch.plan import parse_args, plan, served_name
from tandem.launch.vllm_flags import TABLE, Arity, Fate
from tandem.services.encoder.config import EncoderConfig
from tandem.services.language.config import LanguageConfig
from tandem.services.router.config import RouterConfig

CONFIGS = {"encoder": EncoderConfig, "language": LanguageConfig, "router": RouterConfig}


def settings(argv: list[str], model: str) -> dict[str, object]:
    """kind -> the config each child of `tandem serve argv` would parse."""
    args = serve.parse(argv)
    encoders, languages, router = plan(args, model)
    out = {}
    for child in [encoders[0], languages[0], router]:
        kind = child.argv[3]
        assert child.argv[:3] == [sys.executable, "-m", "tandem.cli"]
        out[kind] = parse_settings(CONFIGS[kind], child.argv[4:], f"tandem {kind}")
    return out | {"up": args}


def test_every_mapped_vllm_flag_reaches_the_tier_that_honours_it(tmp_path):
    model = tmp_path / "Qwen2.5-VL-7B-Instruct"
    model.mkdir()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    got = settings([str(model), "--host", "0.0.0.0", "--port", "9001",
                    "--chat-template", str(template),
                    "--served-model-name", "qwen-vl", "--tensor-parallel-size", "2",
                    "--max-model-len", "4096", "--dtype", "bfloat16",
                    "--gpu-memory-utilization", "0.8", "--max-num-seqs", "48",
                    "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching",
                    "--limit-mm-per-prompt", '{"image": 3}', "--api-key", "k",
                    "--uvicorn-log-level", "warning", "--seed", "7",
                    "--language-args", "--kv-pages 64"],
                   str(model))
    up, enc, lang, router = got["up"], got["encoder"], got["language"], got["router"]
    assert (up.host, up.http_port, up.api_key) == ("0.0.0.0", 9001, "k")
    assert router.model == "qwen-vl" and router.http_port == 9001
    assert (lang.tp, lang.max_model_len, lang.dtype, lang.kv_memory_fraction) == (
        2, 4096, "bfloat16", 0.8)
    assert (lang.max_running_requests, lang.max_prefill_tokens, lang.prefix_cache) == (
        48, 2048, False)
    assert lang.kv_pages == 64  # the caller's own --language-args still apply
    assert lang.seed == 7
    assert (enc.dtype, enc.max_images_per_request) == ("bfloat16", 3)
    assert enc.chat_template == lang.chat_template == str(template)
    assert {enc.log_level, lang.log_level, router.log_level} == {"warning"}
    assert settings([str(model), "--enable-prefix-caching"], str(model))["language"].prefix_cache


def test_chat_template_is_a_file_or_the_template_itself_on_both_tiers(tmp_path):
    """vLLM's --chat-template: a file's path, or the template on one line (escapes as
    vLLM reads them); a path that names no file stops the tier at start, by name."""
    from tandem.chat import load_chat_template

    model = tmp_path / "m"
    model.mkdir()
    inline = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}"
    got = settings([str(model), "--chat-template", inline], str(model))
    assert got["encoder"].chat_template == got["language"].chat_template == inline
    assert load_chat_template(inline) == inline.replace("\\n", "\n")
    with pytest.raises(SystemExit):
        settings([str(model), "--chat-template", str(tmp_path / "missing.jinja")], str(model))


def test_the_served_name_is_the_checkpoint_directory_or_the_hub_id(tmp_path):
    model = tmp_path / "my-checkpoint"
    model.mkdir()
    assert served_name(serve.parse([str(model)]), str(model)) == "my-checkpoint"
    assert served_name(serve.parse(["Qwen/Qwen2.5-VL-3B-Instruct"]),
                       "Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen/Qwen2.5-VL-3B-Instruct"


def test_a_flag_neither_vllm_nor_tandem_up_knows_is_answered_with_where_to_look(capsys):
    assert serve.main(["m", "--no-such-vllm-flag"]) == 2
    err = capsys.readouterr().err
    assert "--no-such-vllm-flag" in err and "tandem serve --help" in err
    assert serve.main(["m", "--encoders", "2", "--demo", "--dry-run"]) == 0  # up's own pass
    assert "--encoders 2 --demo" in capsys.readouterr().out


# A Qwen2.5-VL launch line as vLLM users write it: the harmless flags, vLLM's value forms.
QWEN_VL_LINE = (
    "Qwen/Qwen2.5-VL-7B-Instruct --trust-remote-code --dtype half --max-model-len 32k "
    "--served-model-name qwen2.5-vl qwen --host 0.0.0.0 --port 8001 "
    "--tensor-parallel-size 1 --gpu-memory-utilization 0.9 --max-num-seqs 32 "
    "--limit-mm-per-prompt.image 2 --enable-auto-tool-choice --tool-call-parser hermes "
    "--enable-chunked-prefill --disable-log-stats --disable-log-requests "
    "--enable-prefix-caching --enforce-eager --block-size 32 --max-logprobs 20 "
    "--kv-cache-dtype auto --otlp-traces-endpoint http://collector:4317")
QWEN_VL_NOTICES = ("--trust-remote-code", "--enable-auto-tool-choice",
                   "--tool-call-parser hermes", "--enable-chunked-prefill",
                   "--disable-log-stats", "--disable-log-requests", "--max-logprobs 20",
                   "--kv-cache-dtype auto")


def test_a_vllm_qwen_vl_launch_line_dry_runs_into_the_expected_cluster(capsys):
    """`--dry-run`'s printed command, planned as `tandem up` plans it and read back through
    every tier's settings parser."""
    assert serve.main([*shlex.split(QWEN_VL_LINE), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    command = shlex.split(out)
    assert command[:2] == ["tandem", "up"]
    model = "Qwen/Qwen2.5-VL-7B-Instruct"
    encoders, languages, router = plan(parse_args(command[2:]), model)
    enc, lang, rt = (parse_settings(cls, c.argv[4:], "t") for cls, c in (
        (EncoderConfig, encoders[0]), (LanguageConfig, languages[0]), (RouterConfig, router)))
    assert (enc.dtype, lang.dtype, lang.max_model_len) == ("float16", "float16", 32000)
    assert (rt.model, rt.model_aliases) == ("qwen2.5-vl", ["qwen"])
    assert (rt.host, rt.http_port, rt.grpc_port) == ("0.0.0.0", 8001, 50052)
    assert (lang.tp, lang.kv_memory_fraction, lang.max_running_requests) == (1, 0.9, 32)
    assert (lang.prefix_cache, lang.kv_page_size, lang.cuda_graph_max_bs) == (True, 32, 0)
    assert lang.compile_step == "off"
    assert (enc.max_images_per_request, enc.cuda_graph_max_patches) == (2, 0)
    assert {enc.log_level, lang.log_level, rt.log_level} == {"warning"}
    assert {c.tracing.endpoint for c in (enc, lang, rt)} == {"http://collector:4317"}
    lines = err.splitlines()
    for flag in QWEN_VL_NOTICES:  # one notice line each, nothing else said
        assert sum(line.startswith(f"tandem serve: {flag} (vLLM)") for line in lines) == 1, err
    assert len(lines) == len(QWEN_VL_NOTICES), err


def _configs(argv: list[str]) -> dict[str, object]:
    """What `tandem serve argv` gives `tandem up` and each tier, parsed (ports left out:
    plan() draws free ones)."""
    launch = serve.translate_launch(argv)
    up = {k: v for k, v in vars(parse_args(launch.argv())).items()
          if not k.endswith("_args")}  # the tier flags as text: read below, parsed
    out: dict[str, object] = {"up": up}
    for to, cls in ((vllm_flags.To.ENCODER, EncoderConfig), (vllm_flags.To.LANGUAGE, LanguageConfig),
                    (vllm_flags.To.ROUTER, RouterConfig)):
        argv_t = ["--model", launch.model, *launch.tier[to], *launch.own[to]]
        out[to.value] = parse_settings(cls, argv_t, "t").model_dump()
    return out


def _rows(fate: Fate) -> list:
    return [pytest.param(name, row.example, id=name) for row in TABLE if row.fate is fate
            for name in row.names]


# a mapped flag whose value is Tandem's default is compared with its opposite instead
OPPOSITE = {"--enable-prefix-caching": ["--no-enable-prefix-caching"]}


@pytest.mark.parametrize("flag,example", _rows(Fate.MAPPED))
def test_a_mapped_flag_changes_the_configuration(flag, example, capsys):
    """Nothing mapped is ignored: each changes what `tandem up` or a tier is configured
    with, as the tiers parse it."""
    assert _configs(["m", flag, *example]) != _configs(["m", *OPPOSITE.get(flag, [])])
    assert serve.main(["m", flag, *example, "--dry-run"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("flag,example", _rows(Fate.ACCEPTED))
def test_an_accepted_flag_says_so_once_and_changes_nothing(flag, example, capsys):
    row = vllm_flags.BY_NAME[flag]
    assert serve.main(["m", flag, *example, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"tandem serve: {shlex.join([flag, *example])} (vLLM) "
                                f"accepted: {row.text}"]
    assert serve.main(["m", "--dry-run"]) == 0
    assert capsys.readouterr().out == out


@pytest.mark.parametrize("flag,example", _rows(Fate.REFUSED))
def test_a_refused_flag_exits_2_with_its_reason(flag, example, capsys):
    row = vllm_flags.BY_NAME[flag]
    value = [] if row.arity is Arity.SWITCH else ["x"]
    assert serve.main(["m", flag, *value, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"tandem serve: {shlex.join([flag, *value])} (vLLM) "
                                        f"is refused: {row.text}"), err


@pytest.mark.parametrize("argv", [
    ["--kv-cache-dtype", "fp8"], ["--pipeline-parallel-size", "2"], ["-pp", "4"],
    ["--tool-call-parser", "mistral"], ["--max-logprobs", "50"], ["--api-key", "a", "b"],
    ["--max-model-len", "auto"], ["--max-model-len", "1.5K"], ["--dtype", "half3"],
    ["--limit-mm-per-prompt.audio", "1"], ["--mm-processor-kwargs", '{"fps": 2}'],
    ["--served-model-name", "a,b"], ["--response-role", "user"], ["--device", "tpu"]])
def test_a_value_that_cannot_be_honoured_is_refused_with_the_reason(argv, capsys):
    assert serve.main(["m", *argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{shlex.join(argv)} (vLLM) is refused: " in err, err


@pytest.mark.parametrize("value,expected", [
    ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 10**6), ("1M", 2**20),
    ("2g", 2 * 10**9), ("4096", 4096)])
def test_human_readable_ints_read_as_vllm_reads_them(value, expected):
    """vLLM's human_readable_int: lower-case suffixes decimal, upper-case binary."""
    assert vllm_flags.human_int(value) == expected
    lang = _configs(["m", "--max-model-len", value])["language"]
    assert lang["max_model_len"] == expected


@pytest.mark.parametrize("alias,dtype", [("half", "float16"), ("float16", "float16"),
                                         ("bfloat16", "bfloat16"), ("float", "float32"),
                                         ("float32", "float32"), ("auto", "auto")])
def test_dtype_aliases_reach_both_model_tiers(alias, dtype):
    got = _configs(["m", "--dtype", alias])
    assert got["encoder"]["dtype"] == got["language"]["dtype"] == dtype


def test_vllm_spellings_underscores_inline_values_and_the_model_flag():
    got = _configs(["--max_model_len=4K", "--model", "m", "-tp", "2",
                    "--limit-mm-per-prompt.image", "3", "--limit-mm-per-prompt.video=1"])
    assert (got["language"]["max_model_len"], got["language"]["tp"]) == (4096, 2)
    assert (got["encoder"]["max_images_per_request"],
            got["encoder"]["max_videos_per_request"]) == (3, 1)
    assert got["up"]["model"] == "m"


@pytest.mark.parametrize("argv,http,grpc", [
    (["--port", "9001"], 9001, 51052), (["--port", "30000"], 30000, 7539),
    (["--port", "9001", "--grpc-port", "6000"], 9001, 6000),
    (["--grpc-port=6000", "--port=9001"], 9001, 6000), ([], 8000, 50051)])
def test_port_moves_the_grpc_port_unless_it_is_given(argv, http, grpc):
    up = _configs(["m", *argv])["up"]
    assert (up["http_port"], up["grpc_port"]) == (http, grpc)


def test_moved_grpc_ports_are_distinct_and_valid():
    ports = [serve.grpc_port_for(p) for p in range(1024, 65536)]
    assert len(set(ports)) == len(ports) and min(ports) >= 1024 and max(ports) <= 65535


def test_a_tandem_up_flag_set_twice_differently_names_both(capsys):
    assert serve.main(["m", "--uvicorn-log-level", "info", "--disable-log-requests"]) == 2
    err = capsys.readouterr().err
    assert "--disable-log-requests" in err and "--uvicorn-log-level" in err
    assert serve.main(["m", "--port", "9001", "--http-port", "9002"]) == 2
    assert "--http-port" in capsys.readouterr().err
    assert serve.main(["m", "--uvicorn-log-level", "warning", "--disable-log-requests",
                       "--dry-run"]) == 0  # the same value twice is no conflict


def test_every_refusal_of_a_line_is_reported_at_once(capsys):
    assert serve.main(["m", "--quantization", "awq", "--enable-lora", "--dtype", "half",
                       "--lora-modules", "a=/x", "b=/y", "--kv-cache-dtype", "fp8"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (vLLM)")[0] for line in lines] == [
        "tandem serve: --quantization awq", "tandem serve: --enable-lora",
        "tandem serve: --lora-modules a=/x b=/y", "tandem serve: --kv-cache-dtype fp8"]


def test_several_served_names_are_aliases_the_router_answers_to():
    from tandem.services.router.core import RouterCore
    from tandem.services.router.errors import RouterError
    from tandem.services.router.openai.app import build_app

    router = _configs(["m", "--served-model-name", "a", "b", "c"])["router"]
    assert router["model_aliases"] == ["b", "c"]
    core = RouterCore(RouterConfig(model="a", model_aliases=["b", "c"], insecure_internal=True))
    for name in ("a", "b", "c", "org/c", ""):
        core.check_model(name)
    with pytest.raises(RouterError):
        core.check_model("d")
    client = TestClient(build_app(core))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b", "c"]
    assert client.get("/v1/models/b").json()["id"] == "b"
    assert client.get("/v1/models/d").status_code == 404


def test_help_lists_every_row_and_the_docs_show_the_same_table():
    text = serve.usage()
    assert all(name in text for row in TABLE for name in row.names)
    doc = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    assert vllm_flags.markdown_table() in doc, "docs/serve.md: regenerate the table"


def test_media_limits_map_and_bad_ones_and_missing_values_are_refused_by_name(capsys, tmp_path):
    model = str(tmp_path)
    for given in ('{"image": 3, "video": 2}', "image=3,video=2",
                  '{"image": {"count": 3}, "video": 2}'):
        enc = settings([model, "--limit-mm-per-prompt", given], model)["encoder"]
        assert (enc.max_images_per_request, enc.max_videos_per_request) == (3, 2)
    assert serve.main(["m", "--limit-mm-per-prompt", '{"audio": 1}']) == 2
    assert "--limit-mm-per-prompt" in capsys.readouterr().err
    assert serve.main(["m", "--port"]) == 2
    assert "--port needs a value" in capsys.readouterr().err
    assert serve.main(["--port", "1"]) == 2
    assert "the model comes first" in capsys.readouterr().err


@pytest.mark.parametrize("model,why", [("/nonexistent/checkpoint", "no such checkpoint"),
                                       ("llava", "model_type 'llava' is not supported")])
def test_a_bad_checkpoint_stops_before_anything_starts(model, why, tmp_path):
    """No certificates made, no tier started: the launcher's first line is the error."""
    if model == "llava":
        (tmp_path / "llava").mkdir()
        (tmp_path / "llava" / "config.json").write_text('{"model_type": "llava"}')
        model = str(tmp_path / "llava")
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", model],
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and why in out, out
    assert "starting" not in out and "mTLS" not in out, out


def test_version_on_the_command_line_and_over_http():
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"tandem {tandem.version()}"
    from tandem.services.router.core import RouterCore
    from tandem.services.router.openai.app import build_app

    client = TestClient(build_app(RouterCore(RouterConfig(insecure_internal=True))))
    assert client.get("/version").json() == {"version": tandem.version()}
