"""Language service configuration (`tandem language --help`)."""

from __future__ import annotations

from pydantic import Field

from tandem.config import ModelServiceSettings


class LanguageConfig(ModelServiceSettings):
    """The prefill/decode tier: embedding buffers, paged KV cache, scheduler, sampler."""

    port: int = Field(50071, ge=1, le=65535, description="gRPC port (Generate, Abort, GetLoad).")
    role: str = Field(
        "both", pattern="^(both|prefill|decode)$",
        description="E/P/D (docs/architecture.md, 'Prefill and decode apart'): 'both' "
        "prefills and decodes; 'prefill' runs prompts for decode instances and writes their "
        "KV pages there (its Prefill rpc); 'decode' takes requests that name a prefill "
        "instance, reserves their pages, and decodes. tp 1 and the CPU only (refused "
        "otherwise: the KV pages are packed and checked in host memory).",
    )
    kv_staging_pages: int = Field(
        256, ge=1, le=1 << 20,
        description="Prefill and decode roles: page-sized slots of the registered KV staging "
        "area (the prefill side's outbox, the decode side's inbox); a prompt needs one per "
        "KV page while its pages move. Unused (nothing registered) by 'both'.",
    )
    embedding_block_size: int = Field(
        1024, ge=16, le=65536, description="Tokens per embedding-buffer block."
    )
    embedding_blocks: int = Field(
        64, ge=1, le=1 << 20, description="Embedding-buffer blocks (registered once)."
    )
    embedding_client_share: float = Field(
        0.5, gt=0, le=1,
        description="Most of the embedding blocks the rooms of one client (the router's "
        "client_id) may hold at once; a client's further first reservations wait while "
        "others are served (a client holding none may always take what it needs; resumes "
        "are not limited). Bounds how much a flood of stalled requests can pin.",
    )
    default_reservation_tokens: int = Field(
        8192, ge=16, description="Tokens reserved per room before the first transfer."
    )
    kv_page_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache page.")
    kv_pages: int = Field(
        0, ge=0, description="KV pages; 0 sizes the pool from kv_memory_fraction."
    )
    kv_memory_fraction: float = Field(
        0.5, gt=0, le=0.95,
        description="Share of the device memory free once the weights are loaded and the "
        "largest step and the decode graphs (measured at start-up) are set aside, for the "
        "KV pool (kv_pages 0, CUDA).",
    )
    max_running_requests: int = Field(64, ge=1, le=4096, description="Decode batch cap.")
    max_prefill_tokens: int = Field(
        4096, ge=16, description="Token budget of one prefill step (chunk size)."
    )
    max_model_len: int = Field(
        0, ge=0, description="Max prompt + output tokens; 0 takes the model's limit."
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request has none.")
    schedule_policy: str = Field(
        "fcfs", pattern="^(fcfs|priority)$", description="Waiting-queue order."
    )
    # -- structured output: what one spec may ask of the grammar compiler (a spec over a
    # limit, or one that does not compile in time, is a 400 naming response_format) --
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, le=600,
        description="A grammar still compiling after this long is refused (its compile "
        "process killed); the same spec is then refused at once.",
    )
    grammar_max_compile_cpu_s: float = Field(
        0.5, gt=0, le=600,
        description="A grammar whose compile takes more CPU than this (timed in its compile "
        "process, killed past it) is refused; the same spec is then refused at once. The "
        "language process compiles each admitted spec once more itself (a compiled grammar "
        "cannot be handed over cheaply), where nothing can stop a compile: this bounds that "
        "compile, and so how long one can outlive its request. Raise it to accept costlier "
        "schemas (on a 150,000-token vocabulary an object of 100 fields holding short "
        "strings takes about 1.5 s).",
    )
    grammar_workers: int = Field(
        2, ge=1, le=64,
        description="Grammar compiles run at once, each in its own process (at a lower "
        "priority than decoding); queued compiles are taken one client at a time, in turn, "
        "and one client holds at most half of them (at least one). One more process "
        "compiles small specs only (a few KiB, no large enum or count), so clients "
        "flooding costly specs never hold the process another client's small schema needs.",
    )
    grammar_max_spec_bytes: int = Field(
        256 << 10, ge=1024, description="Largest JSON schema, regex or grammar accepted."
    )
    grammar_max_enum_values: int = Field(
        4096, ge=1, description="Enum values (all of a schema's enums together), or choices."
    )
    grammar_max_enum_chars: int = Field(
        32 << 10, ge=1,
        description="Characters of all of a schema's enum and const values together (or of "
        "the choices): the grammar matches each one, and its compile costs about 10-15 µs "
        "of CPU per character on a 150,000-token vocabulary (32 KiB: about 0.4 s).",
    )
    grammar_max_count: int = Field(
        4096, ge=1,
        description="Largest count a grammar unrolls: a schema's maxLength/minLength/"
        "maxItems/minItems/maxProperties/minProperties, a regex's or pattern's {n,m}.",
    )
    grammar_max_properties: int = Field(
        4096, ge=1, description="Properties of all of a JSON schema's objects together."
    )
    grammar_max_depth: int = Field(32, ge=1, le=1024, description="Deepest JSON-schema nesting.")
    grammar_cache_bytes: int = Field(
        256 << 20, ge=0,
        description="Memory of compiled grammars kept for reuse, each counted as what its "
        "compile grew the heap by (the language process's only grammar cache: xgrammar's "
        "own is off); the least recently used go first, their memory back to the OS.",
    )
    cuda_graph_max_bs: int = Field(
        32, ge=0, le=1024, description="Largest decode batch captured in a CUDA graph; 0 = off."
    )
    attention_backend: str = Field(
        "auto",
        pattern="^(auto|gather|paged_cpu|flex)$",
        description="Attention over the paged KV cache: 'paged_cpu' reads KV pages in place "
        "for decode (a CPU kernel compiled once per machine), 'gather' copies them into a "
        "workspace for SDPA (prefill chunks use SDPA in both); 'flex' runs decode and "
        "prefill through compiled flex_attention over the page table (no copy, no mask "
        "tensor; on CUDA the page size must be a power of two >= 16); 'auto' is paged_cpu "
        "on CPU where it builds, else gather, and flex on CUDA.",
    )
    linear_backend: str = Field(
        "auto",
        pattern="^(auto|torch|packed_cpu)$",
        description="Linear layers and the pointwise steps around them: 'packed_cpu' runs "
        "the linears with our own kernel over weights packed in column strips (2-6x MKL's "
        "sgemm on AMD CPUs) and RMSNorm, rotary and SiLU-mul as one call each (float32 on "
        "CPU only); 'torch' uses torch's ops; 'auto' is packed_cpu where it applies and builds.",
    )
    cpu_bf16_compute: str = Field(
        "auto",
        pattern="^(auto|bfloat16|float32)$",
        description="A bfloat16 model on the CPU: 'float32' runs its linear products and "
        "attention in float32 over the same weight and K/V values (on the packed kernels, "
        "where they apply, the weights stay bfloat16 and are widened as they are read; "
        "with linear_backend torch they are held in float32, twice their memory; the KV "
        "cache stays bfloat16 on the paged_cpu kernels, which widen it as they read, "
        "float32 on the other attention paths; activations stay bfloat16); 'bfloat16' "
        "keeps torch's bfloat16 GEMM; 'auto' is bfloat16 where the CPU has AMX, float32 "
        "elsewhere (without AVX512-BF16 torch's bfloat16 GEMM is 10-60x slower than "
        "float32; with it and no AMX, 0.65-0.8x the packed kernel over bfloat16 weights).",
    )
    compile_step: str = Field(
        "off",
        pattern="^(off|decode|all)$",
        description="CPU: 'decode' compiles the decode step of every batch bucket (1, 2, 4, "
        "8, then every 16 up to cuda_graph_max_bs) with torch.compile (inductor) at "
        "start-up, our kernels inside the graph as custom ops; a bucket not compiled, "
        "prefill and mixed steps run eagerly. 'all' compiles those buckets and one more "
        "graph, of dynamic token counts, that serves every other step (prompt chunks of "
        "any length, several at once, after a cached prefix, beside decode rows); only a "
        "decode batch past the largest bucket runs eagerly. Start-up pays the compiles "
        "(minutes on two cores when cold, seconds from the cache: compile_cache_dir). "
        "'off' runs every step eagerly. Measured on an AVX2 EPYC (docs/benchmarks.md, "
        "issue 45): off by default. Needs the paged_cpu attention (auto's choice where the "
        "kernels build); not with tp > 1 nor a sparse MoE model. No effect on CUDA, where "
        "decode runs in CUDA graphs.",
    )
    compile_cache_dir: str = Field(
        "",
        description="Where inductor keeps its compiled code across starts "
        "(TORCHINDUCTOR_CACHE_DIR) with compile_step decode or all; empty: inductor's "
        "default (/tmp/torchinductor_<user>). A writable volume makes a restart warm.",
    )
    prefix_cache: bool = Field(
        True,
        description="Share whole KV pages between requests whose prompts start alike "
        "(keys chain token ids and image hashes); the encoder then skips what is cached. "
        "--no-prefix-cache turns it off.",
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63,
        description="Seed of the seeds drawn for requests that give none (vLLM's --seed): "
        "the n-th unseeded request to reach the engine after a start always draws the same "
        "seed, so a replayed sequence of requests gives the same tokens. Unset: each "
        "unseeded request draws from the OS's randomness. A request's own `seed` wins.",
    )
    init_new_token_ratio: float = Field(
        0.7, gt=0, le=1.0,
        description="Share of a request's max_tokens reserved in KV pages at admission; "
        "decays towards ~0.1 while nothing is retracted.",
    )
    reattach_grace_s: float = Field(
        1.0, ge=0, le=600,
        description="How long a room whose encoder broke before Done waits for Reattach.",
    )
    cpu_threads: int = Field(0, ge=0, le=1024, description="torch CPU threads; 0 = default.")
    tp: int = Field(
        1, ge=1, le=64,
        description="Tensor-parallel ranks: this instance starts tp - 1 more processes (one "
        "per GPU on CUDA, NCCL; on CPU gloo, the threads split among them), each holding "
        "its shard of the weights and KV cache. Heads, KV heads (or ranks, when fewer), "
        "intermediate sizes must divide evenly.",
    )
    tp_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Longest wait of a tensor-parallel collective (or rank start-up): a "
        "rank that hangs past it ends the instance.",
    )
    cpu_small_step_pool: bool = Field(
        True,
        description="On CPU with cpu_threads > 1, a small step (under cpu_parallel_min_tokens) "
        "still splits its linears across the cores, on a claim-based pool: the step's thread "
        "and cpu_threads - 1 helpers take column strips from one counter, so the step never "
        "waits for a helper that was descheduled (csrc/strip_pool.cpp). "
        "--no-cpu-small-step-pool runs small steps wholly on one thread.",
    )
    cpu_pool_spin_us: int = Field(
        1000, ge=0, le=100_000,
        description="How long a pool helper spins after a job before it sleeps (µs): longer "
        "than the gaps between one step's linears, so it stays awake through a step.",
    )
    cpu_parallel_min_tokens: int = Field(
        16, ge=0, le=1 << 20,
        description="On CPU, a step of fewer tokens (a small decode batch) runs on one "
        "thread and larger ones on cpu_threads: with other processes on the same cores a "
        "small step loses more to waiting for a descheduled thread than it gains; 0 = "
        "always cpu_threads.",
    )
