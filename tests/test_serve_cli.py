"""A vLLM user's command line: `tandem serve MODEL [vLLM flags]` plans the cluster each flag
names (read back through every tier's own settings parser), a vLLM flag without an
equivalent is answered with what to use instead, a bad checkpoint stops the launch before
anything starts, and `tandem --version` / `GET /version` say what runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

import tandem
from tandem.config import parse_settings
from tandem.launch import serve
from tandem.launch.plan import plan, served_name
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
    assert serve.main(["m", "--disable-frontend-multiprocessing"]) == 2
    err = capsys.readouterr().err
    assert "--disable-frontend-multiprocessing" in err and "tandem serve --help" in err
    assert serve.main(["m", "--encoders", "2", "--demo", "--dry-run"]) == 0  # up's own pass
    assert "--encoders 2 --demo" in capsys.readouterr().out


@pytest.mark.parametrize("flag", sorted(serve.HINTS))
def test_a_vllm_flag_without_an_equivalent_gets_a_hint(flag, capsys):
    assert serve.main(["m", flag, "x"]) == 2
    err = capsys.readouterr().err
    assert flag in err and serve.HINTS[flag] in err


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
