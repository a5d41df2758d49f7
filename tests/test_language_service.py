"""A real `tandem language` process, fed by a real encoder-side transfer peer process.

The peer (tests/language_peers/encoder_peer.py) serves Encoder.Attach with the transfer
layer's EmbeddingSender and delivers payloads computed by transformers. The language
process reserves only 32 tokens per room, so longer prompts arrive through several
resumed transfers. Checked over gRPC: greedy output equals `generate()`; health,
reflection, GetLoad, metrics; Abort, client cancel, deadlines, a killed encoder and
Reattach; SIGTERM drain. After each scenario every KV page and embedding block is free.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import language_oracle as oracle
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from language_peers.prompts import make_inputs
from waiting import wait_until

from tandem.launch.procs import free_port
from tandem.v1 import common_pb2, language_pb2, language_pb2_grpc

HERE = Path(__file__).resolve().parent
N_PROMPTS = 16
MAX_NEW = [6 + i % 7 for i in range(N_PROMPTS)]
_rooms = iter(range(1000, 1 << 40))


class EncoderPeer:
    def __init__(self, ckpt: Path, log: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "language_peers" / "encoder_peer.py"), str(ckpt), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
        )
        self.log = log
        self.sent: dict[int, dict] = {}
        self._cond = threading.Condition()

    def wait_ready(self) -> EncoderPeer:
        ready = json.loads(self.proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", f"encoder peer did not start: see {self.log}"
        self.address = ready["address"]
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            ev = json.loads(line)
            with self._cond:
                self.sent[ev["room"] if ev["event"] == "sent" else (ev["event"], ev["room"])] = ev
                self._cond.notify_all()

    def send(self, room: int, prompt: int) -> None:
        self.proc.stdin.write(json.dumps({"op": "send", "room": room, "prompt": prompt}) + "\n")
        self.proc.stdin.flush()

    def wait_sent(self, room: int, timeout: float = 30) -> dict:
        with self._cond:
            assert self._cond.wait_for(lambda: room in self.sent, timeout)
            return self.sent[room]

    def read(self, room: int, timeout: float = 30) -> dict:
        """Nonzero bytes left in the room's blocks, per rank (see encoder_peer.py)."""
        self.proc.stdin.write(json.dumps({"op": "read", "room": room}) + "\n")
        self.proc.stdin.flush()
        with self._cond:
            assert self._cond.wait_for(lambda: ("read", room) in self.sent, timeout)
            return self.sent.pop(("read", room))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Language:
    def __init__(self, ckpt: Path, log: Path, *extra: str) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        args = [
            sys.executable, "-m", "tandem.cli", "language", "--model", str(ckpt),
            "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--kv-page-size", "4", "--kv-pages", "1200", "--max-model-len", "4096",
            "--embedding-block-size", "16", "--embedding-blocks", "64",
            "--default-reservation-tokens", "32", "--max-prefill-tokens", "64",
            "--drain-timeout-s", "1.5", "--reattach-grace-s", "0.5",
            "--transfer.timeout-s", "20", "--cpu-threads", "2", "--insecure-internal", *extra,
        ]
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = language_pb2_grpc.LanguageStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def wait_ready(self) -> Language:
        def serving() -> bool:
            assert self.proc.poll() is None, f"language exited: {self.log.read_text()[-2000:]}"
            try:
                return self.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            except grpc.RpcError:
                return False

        wait_until(serving, timeout_s=180, poll_s=0.2, what="the language instance healthy",
                   state=lambda: self.log.read_text()[-2000:])
        return self

    def generate(self, room, encoder, max_tokens=8, deadline_ms=0, **sampling):
        req = language_pb2.LanguageGenerateRequest(
            room=room, encoder_address=encoder, deadline_unix_ms=deadline_ms,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
        return self.stub.Generate(req, timeout=60)

    def load(self) -> language_pb2.LanguageGetLoadResponse:
        return self.stub.GetLoad(language_pb2.LanguageGetLoadRequest(), timeout=5)

    def assert_all_free(self) -> None:
        """Every page and block is free and no request is held (the wait covers
        cancellation's round trip; it is a hang guard, the claim is the state)."""
        def free() -> bool:
            ld = self.load()
            return (ld.free_kv_pages == ld.total_kv_pages
                    and ld.free_embedding_blocks == ld.total_embedding_blocks
                    and ld.running == ld.waiting == ld.transferring == 0)

        wait_until(free, timeout_s=60, what="every KV page and embedding block free",
                   state=self.load)

    def wait_transferring(self) -> None:
        """Until a room waits for its prompt."""
        wait_until(lambda: self.load().transferring > 0, timeout_s=60, poll_s=0.02,
                   what="a room waiting for its prompt", state=self.load)

    def finished(self) -> dict[str, float]:
        """tandem_language_requests_finished_total by reason ("finished_length", ...)."""
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=30).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^tandem_language_requests_finished_total\{reason="(\w+)"\} (\S+)$', body, re.M)}

    def finished_since(self, before: dict[str, float]) -> dict[str, float]:
        """The requests finished since `before` (a `finished()`), by reason; none: {}."""
        now = self.finished()
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def reference_tokens(ckpt) -> list[list[int]]:
    model, processor = oracle.load(ckpt)
    out = []
    for i in range(N_PROMPTS):
        r = oracle.generate(model, make_inputs(oracle, processor, i), MAX_NEW[i])
        out.append(r[0] if isinstance(r, tuple) else r)
    return out


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    """(language, peer, second peer, reference tokens), started side by side."""
    ckpt = checkpoint("qwen2_5_vl")
    tmp = tmp_path_factory.mktemp("language")
    peers = [EncoderPeer(ckpt, tmp / f"peer{i}.log") for i in range(2)]
    lang = Language(ckpt, tmp / "language.log")
    try:
        refs = reference_tokens(ckpt)  # while the processes start
        for p in peers:
            p.wait_ready()
        yield lang.wait_ready(), peers[0], peers[1], refs
    finally:
        if lang.proc.poll() is None:
            lang.proc.kill()
        lang.proc.wait()
        for p in peers:
            p.kill()


@pytest.fixture(scope="module")
def refs(cluster):
    return cluster[3]


def drain(call) -> list:
    return list(call)


def test_health_reflection_and_load(cluster):
    lang, *_ = cluster
    for service in ("", "tandem.v1.Language"):
        resp = lang.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(lang.channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"tandem.v1.Language", "grpc.health.v1.Health"} <= names
    ld = lang.load()
    assert (ld.total_kv_pages, ld.total_embedding_blocks) == (1200, 64)
    assert Path(ld.model).name.startswith("qwen2_5_vl-tiny") and not ld.draining


def test_concurrent_generations_equal_generate(cluster, refs):
    lang, peer, *_ = cluster
    rooms = [next(_rooms) for _ in range(N_PROMPTS)]
    with ThreadPoolExecutor(N_PROMPTS) as pool:
        futs = [
            pool.submit(drain, lang.generate(room, peer.address, MAX_NEW[i]))
            for i, room in enumerate(rooms)
        ]
        for i, room in enumerate(rooms):
            peer.send(room, i)
        streams = [f.result() for f in futs]
    for i, (msgs, ref) in enumerate(zip(streams, refs, strict=True)):
        assert [t for m in msgs for t in m.token_ids] == ref, f"prompt {i}: {msgs[-1]}"
        last = msgs[-1]
        assert last.finish_reason in (
            common_pb2.FINISH_REASON_LENGTH,
            common_pb2.FINISH_REASON_STOP,
        )
        assert last.usage.completion_tokens == len(ref)
        assert last.usage.total_tokens == last.usage.prompt_tokens + len(ref)
    # prompts longer than the 32-token reservation came through resumed transfers
    sent = [peer.wait_sent(room) for room in rooms]
    assert all(ev["ok"] for ev in sent), [ev for ev in sent if not ev["ok"]]
    resumes = [ev["resumes"] for ev in sent]
    assert sum(r > 0 for r in resumes) >= N_PROMPTS // 2
    lang.assert_all_free()


def test_seeded_sampling_logprobs_and_bad_params(cluster):
    lang, peer, *_ = cluster
    sampling = dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, logprobs=True)
    rooms = [next(_rooms) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(drain, lang.generate(r, peer.address, **sampling)) for r in rooms]
        for r in rooms:
            peer.send(r, 4)
        a, b = (f.result() for f in futs)

    def toks(msgs):
        return [t for m in msgs for t in m.token_ids]

    assert toks(a) == toks(b) and "".join(m.text for m in a) == "".join(m.text for m in b)
    lps = [lp for m in a for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == toks(a) and all(lp.logprob <= 0 for lp in lps)
    bad = drain(lang.generate(next(_rooms), peer.address, top_p=1.5))
    assert bad[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert (bad[-1].error.code, bad[-1].error.field) == ("INVALID_ARGUMENT", "sampling.top_p")
    lang.assert_all_free()


def _first_then(call, action):
    """Read until the first token, run `action`, return the remaining messages."""
    msgs = []
    for m in call:
        msgs.append(m)
        if m.token_ids and len(msgs) == 1:
            action()
    return msgs


def test_abort_cancel_and_deadlines_free_everything(cluster):
    """Each way a request can be ended early ends it and frees everything: none of the
    3000-token generations runs to its length (the finished-requests counter says which
    way each one ended)."""
    lang, peer, *_ = cluster
    long = dict(max_tokens=3000, ignore_eos=True)
    before = lang.finished()
    # Abort RPC while decoding
    room = next(_rooms)
    call = lang.generate(room, peer.address, **long)
    peer.send(room, 3)
    abort = language_pb2.AbortRequest(room=room)
    msgs = _first_then(call, lambda: lang.stub.Abort(abort, timeout=5))
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not lang.stub.Abort(abort, timeout=5).found
    lang.assert_all_free()

    # the client goes away while decoding
    room = next(_rooms)
    call = lang.generate(room, peer.address, **long)
    peer.send(room, 5)
    with pytest.raises(grpc.RpcError) as e:
        _first_then(call, call.cancel)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    lang.assert_all_free()
    # the hang-up ended it (the server aborted it), as the Abort RPC did the first one, not
    # its 3000 tokens
    wait_until(lambda: lang.finished_since(before) == {"finished_abort": 2}, timeout_s=60,
               what="two requests finished, both aborted", state=lambda: lang.finished_since(before))

    # deadline passes while decoding
    room = next(_rooms)
    call = lang.generate(room, peer.address, deadline_ms=int(time.time() * 1000) + 400, **long)
    peer.send(room, 2)
    msgs = drain(call)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert msgs[-1].error.code == "DEADLINE_EXCEEDED"
    lang.assert_all_free()

    # deadline passes while waiting for the prompt (the encoder never sends)
    room = next(_rooms)
    msgs = drain(lang.generate(room, peer.address, deadline_ms=int(time.time() * 1000) + 300))
    assert msgs[-1].error.code == "DEADLINE_EXCEEDED" and not msgs[-1].token_ids
    lang.assert_all_free()

    # Abort RPC while waiting for the prompt
    room = next(_rooms)
    call = lang.generate(room, peer.address)
    lang.wait_transferring()
    assert lang.stub.Abort(language_pb2.AbortRequest(room=room), timeout=5).found
    msgs = drain(call)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    lang.assert_all_free()
    assert "finished_length" not in lang.finished_since(before), lang.finished_since(before)


def test_reattach_and_killed_encoder(cluster, refs):
    lang, peer, other, _ = cluster
    # router retry: a room whose encoder stalls is pointed at another encoder, which delivers
    room = next(_rooms)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(drain, lang.generate(room, other.address, MAX_NEW[7]))
        lang.wait_transferring()
        ok = lang.stub.Reattach(
            language_pb2.ReattachRequest(room=room, encoder_address=peer.address), timeout=5
        )
        assert ok.accepted
        peer.send(room, 7)
        msgs = fut.result()
    assert [t for m in msgs for t in m.token_ids] == refs[7]
    lang.assert_all_free()

    # the encoder dies before delivering: the room fails after the reattach grace
    room = next(_rooms)
    call = lang.generate(room, other.address)
    lang.wait_transferring()
    other.kill()
    msgs = drain(call)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert msgs[-1].error.code == "UNAVAILABLE"
    lang.assert_all_free()


def test_metrics_are_exported(cluster):
    lang, *_ = cluster
    body = urllib.request.urlopen(f"http://127.0.0.1:{lang.metrics_port}/metrics").read().decode()
    for name in (
        "tandem_language_time_to_first_token_seconds_count",
        "tandem_language_time_per_output_token_seconds_count",
        "tandem_language_kv_pages_used",
        "tandem_language_waiting_requests",
        "tandem_language_batch_size_bucket",
        "tandem_language_retractions_total",
        "tandem_language_generation_tokens_total",
    ):
        assert name in body, name
    ttft = [
        ln
        for ln in body.splitlines()
        if ln.startswith("tandem_language_time_to_first_token_seconds_count")
    ]
    assert float(ttft[0].split()[-1]) > 0


def test_sigterm_drains_then_exits(cluster):
    lang, peer, *_ = cluster
    room = next(_rooms)
    call = lang.generate(room, peer.address, max_tokens=3000, ignore_eos=True)
    peer.send(room, 1)
    msgs, states = [], []

    def on_first():
        os.kill(lang.proc.pid, signal.SIGTERM)
        wait_until(lambda: lang.load().draining, timeout_s=60, poll_s=0.02,
                   what="the language instance draining", state=lang.load)
        states.append(lang.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
        refused = drain(lang.generate(next(_rooms), peer.address))
        states.append(refused[-1].error.code)

    msgs = _first_then(call, on_first)
    # the running request was given drain_timeout_s, then aborted with a final message
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert states == [health_pb2.HealthCheckResponse.NOT_SERVING, "UNAVAILABLE"]
    assert lang.proc.wait(timeout=30) == 0
    log = lang.log.read_text()
    assert "KV pages free 1200/1200, embedding blocks free 64/64" in log
