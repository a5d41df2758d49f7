"""Request-level bounds: what one generation request may ask of the router, whatever door
it came in by. `check` is the one place they are enforced: `RouterCore.generate` runs it
on every `Query` before the request is traced or admitted, and nothing else reads these
limits (the doors only translate their wire format; the sampling knobs' own bounds are
`tandem.sampling`'s, which the language tier checks too).

    n              1..MAX_N choices (the gRPC wire's 0 is translated to 1)
    timeout_ms     1..MAX_TIMEOUT_MS, or absent: the router's request_timeout_s (the gRPC
                   wire's 0 is translated to absent)
    stop           each string at most MAX_STOP_CHARS characters (how many: tandem.sampling)
    media bytes    an image's bytes <= max_image_bytes, a video's (or its frames' together)
                   <= max_video_bytes (the router's config); TOO_LARGE (413)
    tools          n > 1 with tools is not served (a tool request is answered whole)

Every refusal is a RouterError naming the wire's field (`param`): INVALID_ARGUMENT (HTTP
400) or TOO_LARGE (HTTP 413, RESOURCE_EXHAUSTED on gRPC). A new bound is a line in the
table above, a check below and its test (tests/test_router_bounds.py)."""

from __future__ import annotations

from tandem.services.router.config import RouterConfig
from tandem.services.router.errors import RouterError
from tandem.services.router.request import Query
from tandem.services.router.tools import ToolMode
from tandem.v1 import common_pb2

MAX_N = 16
# The longest per-request deadline (a day); above it the request is refused, as an absurd
# deadline would overflow the tiers' timers and end the request at once.
MAX_TIMEOUT_MS = 86_400_000
# The longest stop string. The language tier holds back any streamed text that could still
# begin one (services/language/engine/detokenizer.py), so a longer one delays every chunk
# by as much; stop sequences are words or markers, far shorter than this.
MAX_STOP_CHARS = 1024


def check(query: Query, cfg: RouterConfig) -> None:
    """Every request-level bound of `query` (RouterError on the first one it breaks)."""
    if not 1 <= query.n <= MAX_N:
        raise RouterError("INVALID_ARGUMENT", f"n must be in [1, {MAX_N}]", "n")
    if query.timeout_ms is not None and not 1 <= query.timeout_ms <= MAX_TIMEOUT_MS:
        raise RouterError("INVALID_ARGUMENT", f"timeout_ms must be in [1, {MAX_TIMEOUT_MS}] "
                          "(absent: the router's default)", "timeout_ms")
    for s in query.sampling.stop:
        if len(s) > MAX_STOP_CHARS:
            raise RouterError("INVALID_ARGUMENT", f"a stop string is longer than "
                              f"{MAX_STOP_CHARS} characters", "stop")
    if query.n > 1 and query.tools.mode is not ToolMode.NONE:
        raise RouterError("INVALID_ARGUMENT", "n > 1 with tools is not served", "n")
    for i, m in enumerate(query.messages):
        for j, part in enumerate(m.content):
            kind = part.WhichOneof("part")
            if kind == "image":
                _image(part.image, cfg, f"messages[{i}].content[{j}].image")
            elif kind == "video":
                _video(part.video, cfg, f"messages[{i}].content[{j}].video")


def _image(image: common_pb2.ImagePart, cfg: RouterConfig, param: str) -> None:
    if len(image.data) > cfg.max_image_bytes:
        raise RouterError("TOO_LARGE", f"image larger than {cfg.max_image_bytes} bytes", param)


def _video(video: common_pb2.VideoPart, cfg: RouterConfig, param: str) -> None:
    """A video's bytes, or (given as frames) each frame's as an image's and all of them
    together as a video's."""
    if len(video.data) > cfg.max_video_bytes:
        raise RouterError("TOO_LARGE", f"video larger than {cfg.max_video_bytes} bytes "
                          "(the router's max_video_bytes)", param)
    total = 0
    for k, frame in enumerate(video.frames.frames):
        _image(frame, cfg, f"{param}.frames[{k}]")
        total += len(frame.data)
    if total > cfg.max_video_bytes:
        raise RouterError("TOO_LARGE", f"the frames are larger than {cfg.max_video_bytes} "
                          "bytes together (the router's max_video_bytes)",
                          f"{param}.frames")
