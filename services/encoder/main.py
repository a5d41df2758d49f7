"""`tandem encoder`: load the vision part, start the transfer engine and the gRPC server.

Start-up order: model (vision tower + embeddings) -> Mooncake engine + registered staging
-> metrics HTTP (the service's own registry) -> gRPC server (Encoder, health, reflection)
-> "ready" log line.
SIGTERM / SIGINT drain: health turns NOT_SERVING, new Encodes get UNAVAILABLE, Encodes in
progress get up to `drain_timeout_s` to deliver, then the server stops. A stalled ViT
(`vit_stall_s`) takes the encoder out of service the same way until it progresses again.
"""

from __future__ import annotations

import os

# NOTE: set before torch is imported (and MKL first called) in this process. On AVX-512
# CPUs MKL picks GEMM kernels by matrix size, so an image's embeddings could differ in the
# last bits depending on the batch it was encoded in (measured: up to 6e-6 with the small
# checkpoint); strict conditional numerical reproducibility makes each row batch-invariant,
# so a cached image equals a freshly encoded one whatever batch computed it. The test suite
# sets the same value for itself (tests/conftest.py).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import asyncio
import logging

from tandem import serving
from tandem.internal_tls import load_internal_tls
from tandem.metrics import metric_set, serve_metrics, service_registry
from tandem.services.encoder.config import EncoderConfig
from tandem.services.encoder.metrics import EncoderMetrics
from tandem.services.encoder.pipeline import EncodePipeline
from tandem.services.encoder.server import EncoderServicer
from tandem.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger("tandem.encoder")
SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name


def serve(cfg: EncoderConfig) -> int:
    # NOTE: with one CPU thread, float32 rows do not depend on the batch (see vit/runner.py).
    return serving.run_service("tandem encoder", run(cfg), cfg.cpu_threads, cfg.log_format,
                               cfg.log_level, cfg.tracing)


def _message_limit(cfg: EncoderConfig) -> int:
    per_request = (cfg.max_image_bytes * max(1, cfg.max_images_per_request)
                   + cfg.max_video_bytes * cfg.max_videos_per_request) * 4 // 3
    return min(2**31 - 1, per_request + (4 << 20))


async def run(
    cfg: EncoderConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    from tandem.transfer.channels import EncoderChannels
    from tandem.transfer.engine import MooncakeEngine
    from tandem.transfer.sender import EmbeddingSender
    from tandem.transfer.staging import StagingArea

    serving.require_free_ports("tandem encoder", cfg.host, {"--port": cfg.port, "--metrics-port":
                       cfg.metrics_port, "--health-port": cfg.health_port})
    tls = load_internal_tls(cfg, "tandem encoder", "encoder")  # before the model loads
    registry = service_registry()
    metrics = metric_set(EncoderMetrics, registry)
    pipeline = EncodePipeline.from_config(cfg, metrics)
    engine = MooncakeEngine(cfg.transfer)
    staging = StagingArea(
        cfg.staging_slots,
        cfg.staging_tokens,
        pipeline.spec.embed_dim,
        dtype=pipeline.embed_tokens.weight.dtype,
    )
    staging.register(engine)
    # heartbeats only while the ViT progresses (scheduler.py's stall watch)
    sender = EmbeddingSender(engine, staging, cfg.transfer, registry=registry,
                             vouch=lambda: not pipeline.scheduler.stalled())

    limit = _message_limit(cfg)
    server = serving.grpc_server(tls, max_receive_message_length=limit,
                                 max_send_message_length=16 << 20)
    channels = EncoderChannels(grace_s=cfg.transfer.timeout_s, tls=tls)  # to helpers
    servicer = EncoderServicer(pipeline, sender, cfg.model, cfg.request_timeout_s, metrics,
                               channels)
    encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server)
    if cfg.metrics_port:
        serve_metrics(cfg.metrics_port, cfg.host, registry)
    pipeline.start()
    address = f"{cfg.host}:{cfg.port}"
    health_servicer = await serving.start_serving(server, SERVICE, address, "tandem encoder", tls,
                                          cfg.health_port)
    # health follows the stall watch: NOT_SERVING while the ViT is stalled (the drain
    # turns it NOT_SERVING for good)
    following = asyncio.create_task(serving.follow_health(
        health_servicer, SERVICE, servicer.stall, 1.0, log))
    stop = serving.stop_on_signals(stop)
    log.info(
        "encoder ready on %s (model %s, transfer %s, devices %s)",
        address,
        cfg.model,
        engine.session_id,
        [str(r.device) for r in pipeline.scheduler.runners],
    )
    if ready is not None:
        ready.set()
    await stop.wait()
    await serving.drain(servicer, health_servicer, cfg.drain_timeout_s, log)
    following.cancel()
    await server.stop(grace=1.0)
    stalled = pipeline.scheduler.stalled()  # its device thread is then left behind
    await pipeline.stop()
    await channels.close()
    engine.close(wait=False)  # its ports and threads (the sender's rooms ended with the server)
    log.info("encoder stopped")
    if stalled:  # exit status 1: the pod restarts for a reason its log names
        raise SystemExit("tandem encoder: stopped with a ViT call that never returned")
