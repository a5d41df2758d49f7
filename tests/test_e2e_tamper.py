"""A language instance whose embedding buffer is under attack: the router retries the
request elsewhere and the client gets the exact answer (issue 31, finding 1, end to end).

`tandem up` with 1 encoder and 2 language instances. An attacker process with its own
Mooncake engine (tests/transfer_peers/peer.py `reader`) learns language-0's embedding
buffer from Mooncake's handshake and overwrites all of it, again and again, while image
chats go through the router. A request whose rows the attacker overwrote between the
encoder's write and language-0's copy-out fails its MAC check there (DATA_LOSS, before any
prefill); the router retries it on language-1, so the client never sees the attack: every
answer equals transformers `generate()`. The test sends chats until the router has
retried at least one of them (whether a given write lands inside that window is a race;
the count it takes is printed, never bounded by time), then stops the attacker and checks
that every block and page is free on both instances.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from language_oracle import generate, load, make_image, make_inputs
from test_e2e_cluster import png, strip_eos, wait_idle

from tandem.client import Client, image
from tandem.launch.cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).resolve().parent
ARCH = "qwen2_5_vl"
MAX_NEW = 6
BLOCKS, BLOCK_SIZE = 16, 16  # a small buffer: one pass of the attacker takes little time
SIZE = (56, 56)
MAX_CHATS = 40  # the attack must land at least once in this many (it lands in most)
# `language ready on ADDR (model M, DEVICE DTYPE, ..., transfer SESSION)`
READY = re.compile(r"language-0.*language ready on \S+ \(model .*?, \S+ (torch\.\w+), .*"
                   r"transfer (\S+)\)")


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def cluster(ckpt):
    cl = LocalCluster(
        str(ckpt), encoders=1, languages=2,
        language_args=f"--embedding-blocks {BLOCKS} --embedding-block-size {BLOCK_SIZE} "
                      "--default-reservation-tokens 64",
        router_args="--load-refresh-s 0.2",
    )
    cl.start()
    yield cl
    cl.stop()


class Attacker:
    """tests/transfer_peers/peer.py `reader`, driven over JSON lines."""

    def __init__(self, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "transfer_peers" / "peer.py"), "reader"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
        assert self.read().get("event") == "ready", log

    def read(self) -> dict:
        return json.loads(self.proc.stdout.readline() or "{}")

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _buffer_of_language_0(cluster, ckpt: Path) -> tuple[str, int]:
    """(Mooncake session, bytes of its embedding buffer: the first one it registers)."""
    m = next(filter(None, map(READY.search, cluster.lines)))
    dtype = getattr(torch, m.group(1).removeprefix("torch."))
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    hidden = cfg.get("text_config", cfg)["hidden_size"]
    return m.group(2), BLOCKS * BLOCK_SIZE * hidden * dtype.itemsize


def test_tampered_rows_are_retried_on_another_instance_with_the_exact_answer(
        cluster, ckpt, tmp_path):
    model, processor = load(ckpt)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list | tuple) else [eos])
    session, length = _buffer_of_language_0(cluster, ckpt)
    attacker = Attacker(tmp_path / "attacker.log")
    sent, retried, rid = 0, [], ""
    try:
        assert attacker.send(op="tamper_loop", session=session, length=length,
                             byte=0x3C)["event"] == "tampering"
        with Client(cluster.grpc_address) as c:
            while not retried and sent < MAX_CHATS:
                seed, text = 100 + sent, "Describe the picture."
                want, _ = generate(
                    model, make_inputs(processor, text, [make_image(seed, SIZE)]), MAX_NEW)
                try:
                    got = c.chat([{"role": "user", "content": [image(png(seed, SIZE)), text]}],
                                 max_tokens=MAX_NEW, temperature=0)
                except Exception as e:  # what the router did with it, for whoever reads CI
                    said = [ln for ln in cluster.lines if "router" in ln and (
                        "attempt" in ln or "retrying" in ln or "DATA_LOSS" in ln)]
                    raise AssertionError(f"chat {sent + 1} failed: {e}\n" +
                                         "\n".join(said[-12:])) from e
                sent, rid = sent + 1, got.request_id
                assert strip_eos(got.token_ids, eos) == strip_eos(want, eos), (sent, got)
                retried = [ln for ln in cluster.lines
                           if "retrying the request" in ln and "DATA_LOSS" in ln]
        stopped = attacker.send(op="tamper_stop")
    finally:
        attacker.kill()
    print(f"{sent} chats; attacker passes: {stopped.get('passes')}; last request {rid}")
    print("\n".join(retried[:3]))
    assert stopped["rc"] == 0, stopped  # the data plane is open: the writes themselves land
    assert retried, f"no attack landed in {sent} chats (attacker made {stopped['passes']} passes)"
    assert any("DATA_LOSS" in ln for ln in cluster.lines if ln.startswith("language-0"))
    assert wait_idle(cluster)["idle"]
