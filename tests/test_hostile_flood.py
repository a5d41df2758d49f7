"""One client's flood of slow image URLs and huge texts does not shut others out of the
encoder's preprocessing threads, nor of a language instance's embedding blocks (issue 16,
finding 4).

- A real encoder process, driven over gRPC: client A sends Encodes whose image URL
  trickles (each holds a thread for the whole fetch timeout) and Encodes with ~2 MB of
  text; client B's Encodes, each with a deadline far shorter than A's backlog, all arrive.
  Before the fair pool the threads served jobs first come first served: B waited behind
  A's whole backlog and ran out of time.
- A `tandem up` cluster over HTTP: the same flood from one address, another address's
  requests all succeed (success counts only). Besides the encoder's fair pool this needs the
  language side's per-client share of embedding blocks: each flood room reserves its blocks
  when it opens, long before its stalled fetch ends.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from encoder_peers.chats import png, to_proto  # noqa: E402
from encoder_peers.language_side import LanguageSide  # noqa: E402
from encoder_peers.server import EncoderProcess, port_range  # noqa: E402
from encoder_peers.trickle import start_trickle  # noqa: E402
from waiting import async_wait_until  # noqa: E402

from tandem.chat import ImageInput, Message  # noqa: E402
from tandem.v1 import encoder_pb2, encoder_pb2_grpc  # noqa: E402

URL_TIMEOUT_S = 3.0
HUGE_TEXT = "lorem ipsum dolor sit amet " * 75_000  # ~2 MB: just under 32768 tokens x 64


@pytest.fixture(scope="module")
def trickle_url():
    url, stop = start_trickle()
    yield url
    stop()


def _flood_messages(trickle_url: str, i: int) -> list[Message]:
    if i % 3 == 2:  # a huge text with a small image (the image sends it through an encoder)
        return [Message("user", (ImageInput(data=png(32, 32, i)), HUGE_TEXT))]
    return [Message("user", (ImageInput(url=trickle_url), "what is this?"))]


def test_encoder_flood_from_one_client_leaves_another_served(checkpoint, tmp_path, trickle_url):
    from tandem.models.checkpoint import read_spec

    path = checkpoint("qwen2_5_vl")
    log = tmp_path / "encoder.log"
    enc = EncoderProcess(path, log, "--allowed-url-hosts", "127.0.0.1", "--allow-private-urls",
                         "--url-timeout-s", str(URL_TIMEOUT_S), "--preprocess-workers", "2")
    flood_n, calm_n, calm_deadline_s = 12, 4, 6.0
    # NOTE: first come first served, A's backlog (8 fetches of 3 s, 4 texts of ~1 s) kept
    # both threads busy for ~14 s: every calm request's 6 s deadline passed in the queue.

    async def go():
        side = LanguageSide(read_spec(path).embed_dim, port_range(), reserve_tokens=64)
        rooms = iter(range(5000, 10**6))
        async with grpc.aio.insecure_channel(enc.address) as ch:
            stub = encoder_pb2_grpc.EncoderStub(ch)

            def request(client, messages, timeout_s):
                room = next(rooms)
                return room, encoder_pb2.EncodeRequest(
                    room=room, request_id=f"{client}{room}", messages=to_proto(messages),
                    deadline_unix_ms=int((time.time() + timeout_s) * 1000), client_id=client)

            flood = []
            for i in range(flood_n):
                _, req = request("A", _flood_messages(trickle_url, i), 120)
                flood.append(asyncio.ensure_future(stub.Encode(req)))
            await asyncio.sleep(0.5)  # A's backlog is queued
            calm = []
            for i in range(calm_n):
                room, req = request("B", [Message("user", (ImageInput(data=png(48, 40, i)),
                                                          "describe"))], calm_deadline_s)
                got = asyncio.ensure_future(side.receiver.receive(room, enc.address))
                try:
                    resp = await stub.Encode(req)
                    await got
                    calm.append(resp.prompt_tokens > 0)
                except grpc.RpcError as e:
                    side.receiver.abort(room)
                    await asyncio.gather(got, return_exceptions=True)
                    calm.append(f"{e.code().name}: {e.details()}")
            still_flooding = sum(not f.done() for f in flood)
            for f in flood:
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            # A's requests are gone: their threads are let go and the queue empties (the
            # state is the claim; that a request's end stops its fetch at the next byte,
            # not at the url timeout, is test_encoder_units' budget test)
            await async_wait_until(lambda: stub.GetLoad(encoder_pb2.EncoderGetLoadRequest()),
                                   until=lambda load: load.queued_requests == 0,
                                   timeout_s=60, poll_s=0.2,
                                   what="the encoder's queue empty once A's requests are gone")
        await side.receiver.close()
        return calm, still_flooding

    try:
        enc.wait_serving()
        calm, still_flooding = asyncio.run(go())
    finally:
        rc = enc.stop()
    assert calm == [True] * calm_n, calm
    assert still_flooding > 0  # B was served while A's flood was still under way
    assert rc == 0, log.read_text()[-2000:]


# ------------------------------------------------------------------------ whole cluster
def test_cluster_flood_from_one_address_leaves_another_served(checkpoint, trickle_url):
    from tandem.launch.cluster import LocalCluster

    path = checkpoint("qwen2_5_vl")
    cluster = LocalCluster(
        str(path), encoders=1, languages=1,
        encoder_args=f"--allowed-url-hosts 127.0.0.1 --allow-private-urls "
        f"--url-timeout-s {URL_TIMEOUT_S} --preprocess-workers 2",
    )

    def body(messages, timeout_ms):
        return {"model": "", "messages": messages, "max_tokens": 4, "temperature": 0,
                "timeout_ms": timeout_ms}

    def image(data: bytes) -> dict:
        return {"type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}

    async def go(url):
        # two clients, told apart by their source address (both on loopback)
        flooder = httpx.AsyncClient(timeout=120, transport=httpx.AsyncHTTPTransport(
            local_address="127.0.0.1"))
        calm = httpx.AsyncClient(timeout=120, transport=httpx.AsyncHTTPTransport(
            local_address="127.0.0.2"))
        async with flooder, calm:
            flood = []
            for i in range(12):
                if i % 3 == 2:
                    msg = [{"role": "user", "content": [image(png(32, 32, i)),
                                                        {"type": "text", "text": HUGE_TEXT}]}]
                else:
                    msg = [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": trickle_url}},
                        {"type": "text", "text": "what is this?"}]}]
                flood.append(asyncio.ensure_future(flooder.post(url, json=body(msg, 120_000))))
            await asyncio.sleep(1.0)
            codes = []
            for i in range(4):
                msg = [{"role": "user", "content": [image(png(48, 40, i)),
                                                    {"type": "text", "text": "describe"}]}]
                r = await calm.post(url, json=body(msg, 8_000))
                codes.append(r.status_code)
            still = sum(not f.done() for f in flood)
            for f in flood:
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            return codes, still

    with cluster:
        codes, still = asyncio.run(go(cluster.http_url + "/v1/chat/completions"))
    assert codes == [200] * 4, codes
    assert still > 0  # served while the flood was under way
