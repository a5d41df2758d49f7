"""`tandem language`: load the decoder, start the engine thread and the gRPC server.

Start-up order: this process bound to its GPU -> tensor-parallel ranks started (--tp) ->
text weights (split loader), handed to the model runner, which adopts them, measures the
largest step, sizes the KV pool and captures the decode graphs, every rank in step
(runner/kv_sizing.py) -> the other ranks ready -> structured output's mask kernel warmed
-> engine thread -> Mooncake engine + registered embedding buffers -> metrics HTTP (the
service's own registry) -> gRPC server (Language, health, reflection) -> "ready" log line.

SIGTERM / SIGINT drain: health turns NOT_SERVING and new Generates are refused
(UNAVAILABLE); rooms in transfer and requests in the engine get up to `drain_timeout_s`
to finish; whatever is left is aborted (its blocks and pages freed), then the process
exits.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict

from tandem import serving
from tandem.devices import resolve_device, resolve_dtype
from tandem.metrics import metric_set, serve_metrics, service_registry
from tandem.services.language.config import LanguageConfig
from tandem.services.language.engine.core import Engine
from tandem.services.language.engine.grammar import GrammarLimits, warm_masks
from tandem.services.language.engine.types import EngineConfig
from tandem.services.language.handoff import KVPort, refuse_role
from tandem.services.language.metrics import LanguageMetrics
from tandem.services.language.server import LanguageServicer, ServiceLimits
from tandem.v1 import language_pb2, language_pb2_grpc

log = logging.getLogger("tandem.language")
SERVICE = language_pb2.DESCRIPTOR.services_by_name["Language"].full_name


def serve(cfg: LanguageConfig) -> int:
    return serving.run_service("tandem language", run(cfg), cfg.cpu_threads, cfg.log_format,
                               cfg.log_level, cfg.tracing)


def build_engine(cfg: LanguageConfig, metrics: LanguageMetrics):
    """(engine, spec, tokenizer) for `cfg` (also used by the benchmark)."""
    import torch
    from transformers import AutoTokenizer

    from tandem.models.checkpoint import read_spec, resolve_model_path
    from tandem.models.split import load_text_weights
    from tandem.services.language.runner.model_runner import ModelRunner
    from tandem.services.language.tp.ranks import rank_device

    device = rank_device(resolve_device(cfg.device), 0)  # CUDA: with its index (cuda:0)
    if device.type == "cuda":  # this process's GPU: graphs and streams default to it
        torch.cuda.set_device(device)
    if cfg.kv_pages == 0 and device.type != "cuda":  # before the weights load: say it at once
        raise SystemExit(f"tandem language: --kv-pages is needed on {device.type} (kv_pages 0 "
                         "sizes the pool from free GPU memory only; `tandem up` sets one)")
    dtype = resolve_dtype(cfg.dtype, device)
    spec = read_spec(resolve_model_path(cfg.model))
    max_len = cfg.max_model_len or spec.max_position_embeddings
    settings = runner_settings(cfg, device, max_len)
    tp = start_tensor_parallel(cfg, spec, device, dtype, settings) if cfg.tp > 1 else None
    # NOTE: handed over, not kept: the runner consumes the tensors as the decoder adopts
    # them, so no projection is alive twice while loading or while the KV pool is sized.
    runner = ModelRunner(
        load_text_weights(spec, dtype=dtype, device=device, shard=tp.shard if tp else None),
        settings, num_pages=cfg.kv_pages, kv_memory_fraction=cfg.kv_memory_fraction,
        device=device, dtype=dtype, tp=tp)
    if tp is not None:  # the workers built theirs meanwhile, phase by phase with this one
        tp.workers.wait_ready(runner.num_pages)
    warm_masks(runner.device, runner.vocab_size)  # not on the first structured request
    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    engine = Engine(
        runner,
        tokenizer,
        EngineConfig(
            max_prefill_tokens=cfg.max_prefill_tokens,
            max_running_requests=cfg.max_running_requests,
            schedule_policy=cfg.schedule_policy,
            max_model_len=max_len,
            default_max_tokens=cfg.default_max_tokens,
            init_new_token_ratio=cfg.init_new_token_ratio,
            # a decode instance's prompt pages come from its prefill instances (whose
            # caches serve the prefixes): it never matches a prefix, so it keys none
            prefix_cache=cfg.prefix_cache and cfg.role != "decode",
            seed=cfg.seed,
            grammar=GrammarLimits(
                compile_timeout_s=cfg.grammar_compile_timeout_s,
                max_compile_cpu_s=cfg.grammar_max_compile_cpu_s, workers=cfg.grammar_workers,
                max_spec_bytes=cfg.grammar_max_spec_bytes,
                max_enum_values=cfg.grammar_max_enum_values,
                max_enum_chars=cfg.grammar_max_enum_chars, max_count=cfg.grammar_max_count,
                max_properties=cfg.grammar_max_properties, max_depth=cfg.grammar_max_depth,
                cache_bytes=cfg.grammar_cache_bytes),
        ),
        eos_token_ids=tuple(spec.eos_token_ids),
        metrics=metrics,
    )
    return engine, spec, tokenizer


def runner_settings(cfg: LanguageConfig, device, max_len: int):
    """The runner's settings from the config: built once, used by every rank."""
    from tandem.services.language.runner.model_runner import RunnerSettings

    return RunnerSettings(
        page_size=cfg.kv_page_size, max_seq_len=max_len,
        max_prefill_tokens=cfg.max_prefill_tokens, max_decode_rows=cfg.max_running_requests,
        # CPU: the graph runner's buckets are compiled (compile_step), else none
        cuda_graph_max_bs=(cfg.cuda_graph_max_bs
                           if device.type == "cuda" or cfg.compile_step != "off" else 0),
        attention_backend=cfg.attention_backend, linear_backend=cfg.linear_backend,
        cpu_parallel_min_tokens=cfg.cpu_parallel_min_tokens,
        cpu_small_step_pool=cfg.cpu_small_step_pool, cpu_pool_spin_us=cfg.cpu_pool_spin_us,
        cpu_bf16_compute=cfg.cpu_bf16_compute,
        compile_step=cfg.compile_step if device.type == "cpu" else "off",
        compile_cache_dir=cfg.compile_cache_dir,
    )


def start_tensor_parallel(cfg: LanguageConfig, spec, device, dtype, settings):
    """Rank 0's `TensorParallel`, the other ranks started and in the process group."""
    import torch

    from tandem.launch.procs import free_port
    from tandem.services.language.model.shard import Shard
    from tandem.services.language.tp.ranks import RankArgs, start_ranks

    shard = Shard.of(spec, 0, cfg.tp)  # refuses a model --tp does not divide, before spawning
    # NOTE (CPU): the ranks share this host's cores; each gets its part of them.
    threads = max(1, (cfg.cpu_threads or torch.get_num_threads()) // cfg.tp)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    args = RankArgs(
        model=str(spec.path), dtype=str(dtype).removeprefix("torch."), device=str(device),
        runner=asdict(settings), kv_pages=cfg.kv_pages, kv_memory_fraction=cfg.kv_memory_fraction,
        size=cfg.tp, dist_address=f"127.0.0.1:{free_port()}", control_address="",
        timeout_s=cfg.tp_timeout_s, threads=threads, transfer=cfg.transfer.model_dump(),
        embedding_blocks=cfg.embedding_blocks, embedding_block_size=cfg.embedding_block_size,
        tracing=cfg.tracing.model_dump(),
    )
    log.info("starting %d tensor-parallel ranks", cfg.tp)
    return start_ranks(args, device, shard)


def chat_template(path, template: str = ""):
    """The chat template (the checkpoint's, or the deployment's `--chat-template`), for
    text-only chats taken without an encoder."""
    from transformers import AutoProcessor

    import tandem  # noqa: F401  (registers the image-only processors)
    from tandem.chat import ChatTemplate, load_chat_template

    return ChatTemplate(AutoProcessor.from_pretrained(path), load_chat_template(template))


async def run(
    cfg: LanguageConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    from tandem.internal_tls import load_internal_tls
    from tandem.transfer import EmbeddingBuffers, EmbeddingReceiver, ReceiverLimits
    from tandem.transfer.engine import MooncakeEngine
    from tandem.transfer.kv import KVPageLayout, KVStaging

    serving.require_free_ports("tandem language", cfg.host, {"--port": cfg.port, "--metrics-port":
                       cfg.metrics_port, "--health-port": cfg.health_port})
    tls = load_internal_tls(cfg, "tandem language", "language")  # before the model loads
    why = refuse_role(cfg.role, cfg.tp, resolve_device(cfg.device))
    if why:
        raise SystemExit(f"tandem language: {why}")
    registry = service_registry()
    metrics = metric_set(LanguageMetrics, registry)
    engine, spec, _ = build_engine(cfg, metrics)
    engine.start()
    transfer = MooncakeEngine(cfg.transfer)
    # NOTE: embedding buffers live in host memory (the CPU Mooncake build registers host
    # memory only); chunks are copied to the model's device when they run, from each
    # request's private rows, page-locked on CUDA so that upload is asynchronous.
    buffers = EmbeddingBuffers(
        cfg.embedding_blocks, cfg.embedding_block_size, spec.embed_dim, engine.runner.dtype,
        upload_device=engine.runner.device,
    )
    buffers.register(transfer)
    ranks = engine.runner.tp.workers.buffers if engine.runner.tp is not None else None
    if ranks is not None:
        ranks.check_mirror(buffers.layout())
    receiver_limits = ReceiverLimits(
        reserve_tokens=cfg.default_reservation_tokens,
        client_share=cfg.embedding_client_share,
        reattach_grace_s=cfg.reattach_grace_s,
        max_prompt_tokens=cfg.max_model_len or spec.max_position_embeddings,
    )
    receiver = EmbeddingReceiver(
        transfer, buffers, cfg.transfer, receiver_limits, registry=registry, ranks=ranks, tls=tls,
        on_prompt=engine.pin_prefix,  # the prefix cache answers what it holds (pinned)
    )
    allocator = receiver.allocator
    port = None
    if cfg.role != "both":  # E/P/D: the registered KV staging (outbox or inbox)
        staging = KVStaging(KVPageLayout.of_cache(engine.runner.kv), cfg.kv_staging_pages)
        staging.register(transfer)
        port = KVPort(cfg.role, transfer, staging, engine.runner.kv, cfg.transfer)

    # NOTE: a request as large as the router accepts (64 MiB) reaches the tier, whose own
    # checks name what is too large (`messages`: more text than max_prompt_tokens can hold);
    # gRPC's default 4 MiB would refuse it first, with a message about the wire
    server = serving.grpc_server(tls, max_send_message_length=16 << 20,
                                 max_receive_message_length=64 << 20)
    limits = ServiceLimits(cfg.request_timeout_s, cfg.model,
                           max_prompt_tokens=engine.cfg.max_model_len - 1)
    servicer = LanguageServicer(engine, receiver, allocator, limits, metrics,
                                template=chat_template(spec.path, cfg.chat_template),
                                port=port, tls=tls)
    language_pb2_grpc.add_LanguageServicer_to_server(servicer, server)
    if cfg.metrics_port:
        serve_metrics(cfg.metrics_port, cfg.host, registry)
    address = f"{cfg.host}:{cfg.port}"
    health_servicer = await serving.start_serving(server, SERVICE, address, "tandem language", tls,
                                          cfg.health_port)
    stop = serving.stop_on_signals(stop)
    log.info(
        "language ready on %s (model %s, %s %s, %d KV pages of %d, role %s, transfer %s)",
        address, cfg.model, engine.runner.device, engine.runner.dtype,
        engine.pool.num_total, engine.runner.page_size, cfg.role, transfer.session_id,
    )
    if ready is not None:
        ready.set()
    await stop.wait()

    if await serving.drain(servicer, health_servicer, cfg.drain_timeout_s, log):
        for room in list(servicer.transferring):  # the engine's are aborted by its stop
            receiver.abort(room)
    engine.stop()  # aborts what is left: each stream gets its final ABORT message
    if engine.runner.tp is not None:
        engine.runner.tp.workers.stop()
    await serving.wait_idle(lambda: servicer.num_active, 2.0, poll_s=0.02)
    await server.stop(grace=1.0)
    await receiver.close()
    transfer.close(wait=False)  # its ports and threads (every room ended with the receiver)
    log.info(
        "language stopped (KV pages free %d/%d, embedding blocks free %d/%d)",
        engine.pool.num_free, engine.pool.num_total, allocator.num_free, allocator.num_total,
    )
