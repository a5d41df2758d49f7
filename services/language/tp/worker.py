"""A tensor-parallel rank other than 0: `python -m tandem.services.language.tp.worker RANK ARGS_JSON`.

Started by rank 0 (`tandem.services.language.tp.ranks.start_ranks`), never by hand. It binds to
its device, joins the process group, loads its shard and builds the same runner as rank 0
(at the same time as rank 0: the runner's start-up phases meet in collectives, the KV page
count agreed among them), says it is ready, then runs every step rank 0 sends until told
to stop or rank 0 is gone. See ranks.py for the whole protocol.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from dataclasses import asdict
from multiprocessing.connection import Client

import torch

from tandem import tracing
from tandem.services.language.tp import wire
from tandem.services.language.tp.ranks import RankArgs, TensorParallel, init_group, rank_device
from tandem.tracing import TracingConfig

log = logging.getLogger("tandem.language.tp")


def main(rank: int, args: RankArgs) -> int:
    # NOTE: SIGINT/SIGTERM reach the whole process group (Ctrl-C, `tandem up`); rank 0
    # drains first and then stops this rank, so they are not ours to act on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(args.threads)
    # the rank's own spans (tp.gather) join rank 0's traces (tandem/tracing.py)
    tracing.setup(TracingConfig(**(args.tracing or {})), "tandem-language",
                  {"tandem.tp.rank": rank})
    device = rank_device(torch.device(args.device), rank)
    init_group(rank, args.size, args.dist_address, device, args.timeout_s)
    host, port = args.control_address.rsplit(":", 1)
    authkey = bytes.fromhex(os.environ["TANDEM_TP_AUTHKEY"])
    conn = Client((host, int(port)), authkey=authkey)
    conn.send_bytes(wire.encode_json({"rank": rank, "channel": "step"}))
    data_conn = Client((host, int(port)), authkey=authkey)
    data_conn.send_bytes(wire.encode_json({"rank": rank, "channel": "data"}))
    # NOTE: imported once in the group: the join is bounded by the start-up timeout
    # (ranks.start_timeout_s), and the model's modules take seconds to import on a loaded host
    from tandem.config import TransferConfig
    from tandem.devices import DTYPES
    from tandem.models.checkpoint import read_spec, resolve_model_path
    from tandem.models.split import load_text_weights
    from tandem.services.language.model.shard import Shard
    from tandem.services.language.runner.model_runner import ModelRunner, RunnerSettings
    from tandem.services.language.tp.buffers import WorkerBuffers
    from tandem.transfer import EmbeddingBuffers, MooncakeEngine

    spec = read_spec(resolve_model_path(args.model))
    shard = Shard.of(spec, rank, args.size)

    # NOTE: handed over (the runner consumes the tensors); built now, while rank 0 builds
    # its own: its phases (measured steps, the page count, graph capture) meet rank 0's.
    runner = ModelRunner(load_text_weights(spec, DTYPES[args.dtype], device, shard),
                         RunnerSettings(**args.runner), num_pages=args.kv_pages,
                         kv_memory_fraction=args.kv_memory_fraction, device=device,
                         dtype=DTYPES[args.dtype], tp=TensorParallel(rank, shard, device))
    # This rank's embedding buffers, a mirror of rank 0's pool: the encoder writes every
    # prompt here too (buffers.py). Host memory, as on rank 0.
    transfer = MooncakeEngine(TransferConfig(**args.transfer))
    buffers = EmbeddingBuffers(args.embedding_blocks, args.embedding_block_size, spec.embed_dim,
                               DTYPES[args.dtype], upload_device=device)
    buffers.register(transfer)
    held = WorkerBuffers(data_conn, buffers)
    held.start()
    conn.send_bytes(wire.encode_json({"ready": True, "num_pages": runner.num_pages,
                                      "session_id": transfer.session_id,
                                      "layout": asdict(buffers.layout())}))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            log.error("rank %d: rank 0 is gone; exiting", rank)
            return 1
        if data == wire.STOP:
            return 0
        batch = wire.decode_step(data, held.take)
        # NOTE: rank 0 checked the batch before sending it; any failure here (a collective
        # that timed out, a peer gone) ends this rank, and rank 0 ends the instance.
        runner.forward(batch)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    sys.exit(main(int(sys.argv[1]), RankArgs(**json.loads(sys.argv[2]))))
