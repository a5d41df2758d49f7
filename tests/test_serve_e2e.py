"""`tandem serve` started with a vLLM Qwen2.5-VL launch line as a user copies it (the
harmless flags, `--dtype half`, `--max-model-len 32k`, two served names, the qwen3
reasoning parser, a local media path) really serves: both names answer the same greedy
chat, `/v1/models` lists both, a `file://` image under the allowed path answers as its data
URL does, and one outside it is a 400. (test_serve_cli.py checks the translation of every
flag without starting anything; this is the one run of the whole line.)"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys

import httpx
import pytest
from waiting import wait_until

pytestmark = pytest.mark.timeout(420)


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _line(model: str, port: int, media: str) -> list[str]:
    return [model, "--trust-remote-code", "--dtype", "half", "--max-model-len", "32k",
            "--served-model-name", "qwen2.5-vl", "qwen", "--port", str(port),
            "--reasoning-parser", "qwen3", "--allowed-local-media-path", media,
            "--tensor-parallel-size", "1", "--max-num-seqs", "8",
            "--limit-mm-per-prompt.image", "2", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--enable-chunked-prefill",
            "--disable-log-stats", "--disable-log-requests", "--enable-prefix-caching",
            "--enforce-eager", "--max-logprobs", "20", "--kv-cache-dtype", "auto"]


def test_a_vllm_launch_line_serves_through_both_names(checkpoint, tmp_path):
    from tandem.launch.procs import free_port

    model = str(checkpoint("qwen2_5_vl"))
    media = tmp_path / "media"
    media.mkdir()
    raw = _png()
    (media / "cat.png").write_bytes(raw)
    (tmp_path / "outside.png").write_bytes(raw)
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", *_line(model, port, str(media))],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            return httpx.get(f"{url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def chat(name: str, image_url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": name, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": "What is in the picture?"}]}]})

    try:
        wait_until(ready, timeout_s=300, what="tandem serve ready",
                   state=lambda: (tmp_path / "serve.log").read_text()[-2000:])
        names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
        assert names == ["qwen2.5-vl", "qwen"]
        data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
        answers = []
        for name in names:
            r = chat(name, data_url)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"])
        assert answers[0] == answers[1]  # one model behind both names, greedy
        by_file = chat("qwen", f"file://{media / 'cat.png'}")
        assert by_file.status_code == 200, by_file.text
        assert by_file.json()["choices"][0]["message"] == answers[0]
        outside = chat("qwen", f"file://{tmp_path / 'outside.png'}")
        assert outside.status_code == 400, outside.text
        assert chat("neither", data_url).status_code == 404
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
