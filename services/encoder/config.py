"""Encoder service configuration (`tandem encoder --help`)."""

from __future__ import annotations

from pydantic import Field

from tandem.config import ModelServiceSettings


class EncoderConfig(ModelServiceSettings):
    """The ViT encode tier: preprocessing, vision tower, embedding cache, transfer out."""

    port: int = Field(50061, ge=1, le=65535, description="gRPC port (Encode, Attach, GetLoad).")
    # The encoder's own default: an Encode ends once its prompt is delivered, not when a
    # generation does.
    request_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Default deadline of a request without one."
    )
    min_pixels: int = Field(
        0,
        ge=0,
        description="Smallest image area after smart_resize (pixels); 0 = the checkpoint's.",
    )
    max_pixels: int = Field(
        0,
        ge=0,
        description="Largest image area after smart_resize (pixels); 0 = the checkpoint's.",
    )
    max_source_pixels: int = Field(
        40_000_000, ge=784, description="Largest decoded image (width * height) accepted."
    )
    max_image_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, description="Largest encoded image accepted (bytes)."
    )
    max_images_per_request: int = Field(16, ge=0, le=1024, description="Images per request.")
    max_prompt_tokens: int = Field(
        32768, ge=16, description="Largest prompt (text + image tokens) accepted."
    )
    max_videos_per_request: int = Field(
        4, ge=0, le=64, description="Videos per request (0 refuses video parts)."
    )
    max_video_bytes: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="Largest video file accepted (bytes; inline, data URL or download).",
    )
    max_video_duration_s: float = Field(
        600.0, gt=0, description="Longest video accepted: frames / frame rate, as its header "
        "says (seconds).",
    )
    max_video_frames: int = Field(
        18_000, ge=2, description="Most frames a video file may hold (header, or counted).",
    )
    max_video_decoded_pixels: int = Field(
        4_000_000_000, ge=1,
        description="Most pixels (width * height, summed over every frame decoded up to the "
        "last one sampled) one video may decode.",
    )
    max_video_decode_s: float = Field(
        60.0, gt=0, le=3600, description="Longest one video's decode may run (seconds).",
    )
    max_video_tokens: int = Field(
        32_768, ge=1, description="Most vision tokens one video may become after sampling and "
        "resizing (refused before it is decoded).",
    )
    # How the defaults of the three fields below were chosen (libx264 mp4s decoded here, one
    # decoding thread, torch on one thread; 'work' = pixels decoded + 12 x pixels sampled,
    # a sampled pixel's RGB conversion and resize costing 8-15x its decode):
    #   58 KB, 4096x4096 x 230 black frames (the bomb)    125,000 work/B  7.6 s  131 s/MiB
    #   1080p one slide, 2 min at 2 fps, x264 medium       34,400 work/B  2.0 s   36 s/MiB
    #   1080p one slide, 10 min at 2 fps, ultrafast        14,500 work/B  12 s    18 s/MiB
    #   1080p new slide every 30 s, 10 min, x264 medium    14,300 work/B  7-19 s  10-28 s/MiB
    #   1080p new slide every 15 s, 10 min, ultrafast       2,700 work/B  4.5-12 s 1.3-3.6
    # (slides sampled at 0.5 fps; the times vary 2-4x with the load of the shared CPUs).
    # Work grows with the frames and bytes with the slides shown (and one key frame per 250
    # frames), so a deck's ratios hold whatever its length (2 and 10 minutes of one slide:
    # 14,200 and 14,500 work/B).
    video_decode_pixels_per_byte: int = Field(
        60_000, ge=1,
        description="Decode work each byte of a video buys, checked from its header and "
        "sampling plan before any frame is decoded: pixels decoded (every frame up to the "
        "last sampled one) + 12 x pixels sampled (each converted and resized at full size) "
        "may be at most this times the file's bytes (at least video_decode_min_bytes), so a "
        "tiny file declaring huge frames is refused at once. The default is 1.7x the most "
        "compressible slide video measured (one 1080p slide throughout, x264 medium: 34,400 "
        "per byte) and half a 58 KB 4096x4096 x 230-frame mp4's 125,000.",
    )
    video_decode_s_per_mib: float = Field(
        90.0, gt=0,
        description="Decode CPU time each MiB of a video buys (the file's bytes, at least "
        "video_decode_min_bytes), checked while decoding on the decoding thread's own CPU "
        "clock, so other requests' load cannot push a file over it (max_video_decode_s "
        "bounds the wall time beside it): a file slower per pixel than its work says still "
        "stops at what its bytes paid for. Slide videos measured 1.3-36 s per MiB of wall "
        "time on a loaded machine (36: one 1080p slide throughout, x264 medium), so 90 "
        "leaves the slowest 2.5x; a 58 KB file gets 5 s, not max_video_decode_s.",
    )
    video_decode_min_bytes: int = Field(
        32 * 1024, ge=1,
        description="A video smaller than this is budgeted (video_decode_pixels_per_byte, "
        "video_decode_s_per_mib) as if it were this size: a short clip's floor (32 KiB buy "
        "2.0e9 work and 2.8 s).",
    )
    allowed_url_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts whose http(s) image and video URLs may be fetched; empty refuses "
        "all URLs.",
    )
    allow_private_urls: bool = Field(
        False, description="Allow URLs resolving to private/loopback addresses."
    )
    allowed_local_media_path: str = Field(
        "",
        description="A directory whose files may be sent as file:// image and video URLs "
        "(vLLM's --allowed-local-media-path): only a regular file whose real path, every "
        "symlink resolved, lies under it, under the same byte limits as a data URL; any other "
        "file:// URL is a 400 naming the part. Empty (the default) refuses every file:// "
        "URL. Anyone who can send a request reads the files there: point it at media only. "
        "Checked at start-up (an existing directory).",
    )
    url_timeout_s: float = Field(5.0, gt=0, le=120, description="Total time of one image or "
        "video fetch (each read and the whole download: a slow trickle is cut off too).")
    patch_budget: int = Field(
        16384, ge=64, description="Max vision patches in one batched ViT call."
    )
    video_chunk_patches: int = Field(
        1024, ge=0,
        description="With streamed rows (--transfer.stream): a video goes through the ViT in "
        "runs of whole temporal groups of at most this many patches (at least one group), "
        "each run's rows sent as it ends; 0 = the whole video as one input. Without "
        "streaming a video is always one input.",
    )
    preprocess_workers: int = Field(2, ge=1, le=64, description="Preprocessing worker threads.")
    preprocess_client_share: int = Field(
        0, ge=0, le=64,
        description="Most preprocessing threads one client (the router's client_id) may hold "
        "at once; free threads serve waiting clients in turn. 0 = half the threads (at least "
        "1), so one client's slow image URLs or huge inputs never hold them all.",
    )
    cache_bytes: int = Field(
        512 * 1024 * 1024, ge=0, description="Embedding cache byte budget; 0 disables it."
    )
    devices: list[str] = Field(
        default_factory=list,
        description="Devices to run one vision tower each on (e.g. 'cuda:0,cuda:1'); "
        "empty = just `device`. Batches are split largest-image-first across them.",
    )
    cpu_threads: int = Field(
        1,
        ge=0,
        le=256,
        description="torch intra-op threads on CPU (0 = torch's default). With 1, batched "
        "and one-at-a-time encodes are bit-identical in float32.",
    )
    linear_backend: str = Field(
        "auto",
        pattern="^(auto|torch|packed_cpu)$",
        description="The vision tower's linear layers: 'packed_cpu' runs them with our own "
        "kernel over weights packed in column strips (float32 on CPU only; 2-3x MKL's sgemm "
        "at ViT sizes on AMD CPUs), 'torch' with nn.Linear; 'auto' is packed_cpu where it "
        "applies and builds.",
    )
    cpu_bf16_compute: str = Field(
        "auto",
        pattern="^(auto|bfloat16|float32)$",
        description="A bfloat16 model on the CPU: 'float32' runs the vision tower in float32 "
        "over the same weight values (the tower's weights held in float32, twice their "
        "memory; on the packed kernels where they apply) and sends its rows in bfloat16; "
        "'bfloat16' keeps torch's bfloat16 ops; 'auto' is bfloat16 where the CPU has "
        "AMX, float32 elsewhere (without AVX512-BF16 a 448x336 image took 7.7x as long in "
        "bfloat16 as in float32; with it and no AMX, torch's bfloat16 GEMM is slower than "
        "the packed float32 kernel at every size measured).",
    )
    cuda_graph_max_patches: int = Field(
        16384, ge=0, le=1 << 20,
        description="Largest ViT batch (patches) the CUDA graphs cover: one graph per bucket "
        "(256, 384, 512, 768, ... up to this; with bf16/fp16 varlen attention also per bound "
        "of the longest image, 256, 512, ... up to the bucket), all captured at start-up; a "
        "batch is padded up to its bucket, a bigger one runs eagerly. 0 disables graphs; "
        "CUDA only (the CPU runs eagerly).",
    )
    vit_stall_s: float = Field(
        60.0, gt=0, le=3600,
        description="A ViT call that goes this long without finishing a layer is taken "
        "for a hang: the encoder stops its rooms' heartbeats (the language side fails them "
        "at the transfer timeout and the router retries their requests elsewhere), refuses "
        "new Encodes and ranges UNAVAILABLE, says so in its load reports and answers health "
        "checks NOT_SERVING, until the call progresses again. On CUDA a layer (or a graph "
        "replay) returns once queued, so there the bound is on one whole call's GPU time. "
        "Raise it for a real-size tower on a few CPU cores, where one layer of the largest "
        "input (a batch's first input runs whatever its size) may take tens of seconds.",
    )
    staging_tokens: int = Field(
        4096, ge=16, description="Tokens per staging slot (>= the language block size)."
    )
    staging_slots: int = Field(
        2, ge=1, le=64, description="Transfer staging slots (pieces in flight at once)."
    )
