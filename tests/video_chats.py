"""Chats with videos, in every form the tests need, and transformers' answer to them.

A `VideoChat` is one user turn of parts: text, images (a seed and a size) and videos (a
clip of test_video_preprocess.CLIPS, or `Frames`: a video given as frames), all its videos
under one `VideoOptions`. It becomes
the encoder's `Message`s, an OpenAI body's messages, or a case of
tests/oracle/video_generate.py, which `oracle_results` runs in `.oracle-venv` (one
subprocess for all cases): transformers' processor and greedy `generate()`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
from pathlib import Path

from encoder_peers.chats import png
from test_video_preprocess import CLIPS, ORACLE_PY, ROOT, make_clip

from tandem.chat import ImageInput, Message, VideoInput, VideoOptions

GENERATE_SCRIPT = ROOT / "tests" / "oracle" / "video_generate.py"


@dataclasses.dataclass(frozen=True)
class Image:
    seed: int
    size: tuple[int, int]

    def png(self) -> bytes:
        return png(*self.size, self.seed)


@dataclasses.dataclass(frozen=True)
class Video:
    clip: str  # a key of CLIPS


@dataclasses.dataclass(frozen=True)
class Frames:
    """A video given as frames: `count` seeded noise images of `size`, PNG or JPEG."""

    count: int
    size: tuple[int, int]
    seed: int = 0
    fmt: str = "PNG"

    def files(self) -> list[bytes]:
        return [png(*self.size, self.seed * 1000 + i, self.fmt) for i in range(self.count)]


@dataclasses.dataclass(frozen=True)
class VideoChat:
    """All its videos under `options`; a chat with `Frames` holds no `Video` (transformers'
    processor call samples every video of a chat alike)."""

    parts: tuple[str | Image | Video | Frames, ...]
    options: VideoOptions = VideoOptions()
    system: str = "You are terse."

    def messages(self, clips: dict[str, bytes]) -> list[Message]:
        """The encoder's form."""
        parts = [p if isinstance(p, str) else ImageInput(data=p.png()) if isinstance(p, Image)
                 else VideoInput(frames=tuple(ImageInput(data=f) for f in p.files()),
                                 options=self.options) if isinstance(p, Frames)
                 else VideoInput(data=clips[p.clip], options=self.options)
                 for p in self.parts]
        return [Message("system", (self.system,)), Message("user", tuple(parts))]

    def openai(self, clips: dict[str, bytes]) -> list[dict]:
        """The OpenAI body's form: data URLs, the options inside each video_url part."""
        controls = {k: v for k, v in dataclasses.asdict(self.options).items() if v is not None}
        parts = []
        for p in self.parts:
            if isinstance(p, str):
                parts.append({"type": "text", "text": p})
            elif isinstance(p, Image):
                url = "data:image/png;base64," + base64.b64encode(p.png()).decode()
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif isinstance(p, Frames):  # qwen-vl-utils' form: a list of image URLs
                mime = f"data:image/{p.fmt.lower()};base64,"
                urls = [mime + base64.b64encode(f).decode() for f in p.files()]
                parts.append({"type": "video", "video": urls, **controls})
            else:
                url = "data:video/mp4;base64," + base64.b64encode(clips[p.clip]).decode()
                parts.append({"type": "video_url", "video_url": {"url": url, **controls}})
        return [{"role": "system", "content": self.system}, {"role": "user", "content": parts}]

    def oracle_messages(self, files: dict[str, Path], tmp: Path) -> list[dict]:
        content = []
        for p in self.parts:
            if isinstance(p, str):
                content.append({"type": "text", "text": p})
            elif isinstance(p, Image):
                path = tmp / f"img-{p.seed}-{p.size[0]}x{p.size[1]}.png"
                path.write_bytes(p.png())
                content.append({"type": "image", "path": str(path)})
            elif isinstance(p, Frames):
                paths = []
                for i, f in enumerate(p.files()):
                    paths.append(str(tmp / f"frame-{p.seed}-{p.size[0]}x{p.size[1]}-{i}."
                                     f"{p.fmt.lower()}"))
                    Path(paths[-1]).write_bytes(f)
                content.append({"type": "video", "frames": paths, "fps": self.options.fps})
            else:
                content.append({"type": "video", "path": str(files[p.clip])})
        return [
            {"role": "system", "content": [{"type": "text", "text": self.system}]},
            {"role": "user", "content": content},
        ]


def write_clips(tmp: Path) -> tuple[dict[str, bytes], dict[str, Path]]:
    """Every clip of CLIPS: its bytes and its file."""
    raw, files = {}, {}
    for key, c in CLIPS.items():
        files[key] = tmp / c.name
        raw[key] = make_clip(c, files[key])
    return raw, files


def oracle_results(
    cases: dict[str, tuple[str, VideoChat]],
    checkpoint,
    files: dict[str, Path],
    tmp: Path,
    max_new_tokens: int,
    payload: bool = False,
) -> dict:
    """transformers' results for {case id: (arch, chat)} (tests/oracle/video_generate.py):
    {id: {"input_ids", "positions", "delta", "tokens", ...}}; with `payload` the prompt
    embeddings in tmp/<id>.npy. A case transformers refuses fails the calling test."""
    from tandem.services.encoder.media.video_rules import Sampling, VideoSettings

    if not ORACLE_PY.exists():
        raise AssertionError(
            f"{ORACLE_PY.relative_to(ROOT)} is missing: `make test` builds "
            "it (or `make oracle-venv` alone)"
        )
    jobs = []
    for case_id, (arch, chat) in cases.items():
        settings = VideoSettings.from_checkpoint(checkpoint(arch))
        if any(isinstance(p, Frames) for p in chat.parts):
            assert not any(isinstance(p, Video) for p in chat.parts), case_id
            init, call = Sampling.resolve_frames(settings, chat.options).processor_kwargs(True)
        else:
            init, call = Sampling.resolve(settings, chat.options).processor_kwargs()
        jobs.append({"id": case_id, "arch": arch, "checkpoint": str(checkpoint(arch)),
                     "messages": chat.oracle_messages(files, tmp), "init": init, "call": call,
                     "max_new_tokens": max_new_tokens, "payload": payload})
    (tmp / "job.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [str(ORACLE_PY), str(GENERATE_SCRIPT), str(tmp / "job.json"), str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"the oracle failed:\n{r.stderr[-4000:]}"
    results = json.loads((tmp / "results.json").read_text())
    failed = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not failed, f"transformers refused: {failed}"
    return results
