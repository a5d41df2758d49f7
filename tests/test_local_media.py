"""file:// media under the encoder's allowed_local_media_path (vLLM's
--allowed-local-media-path, issue 42).

- Off by default: every file:// URL is refused, naming the part.
- On: a regular file whose real path lies under the directory is read, under the same
  byte cap as a data URL; a path outside (absolute, `..`, or a symlink inside that points
  out) is refused whether or not the file exists; so are a directory, a FIFO, a missing
  file, a URL with a host. Images, videos and a video's frames alike.
- Through the encode pipeline, a file:// image gives exactly the payload of the same
  image as a data URL.
- The flag: `tandem serve --allowed-local-media-path D` gives the encoder that directory,
  and an encoder refuses to start on a path that is no directory.
"""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest
import torch
from encoder_peers.chats import png

from tandem.chat import ChatError, ImageInput, Message, VideoOptions
from tandem.launch import serve
from tandem.launch.vllm_flags import To
from tandem.services.encoder.chat import EncodeJob
from tandem.services.encoder.config import EncoderConfig
from tandem.services.encoder.media.images import (
    ImageLimits,
    SourceRules,
    image_bytes,
    local_media_root,
    source_bytes,
)
from tandem.services.encoder.media.video import VideoLimits
from tandem.services.encoder.media.video_frames import plan_frames_source
from tandem.services.encoder.media.video_rules import VideoSettings
from tandem.services.encoder.pipeline import EncodePipeline

IMAGE = png(40, 30, 7)
FIELD = "messages[0].content[1].image"


@pytest.fixture
def media(tmp_path) -> tuple[Path, Path]:
    """(allowed directory, a directory outside it), with files and symlinks in them."""
    root, out = tmp_path / "media", tmp_path / "private"
    (root / "sub").mkdir(parents=True)
    out.mkdir()
    (root / "a.png").write_bytes(IMAGE)
    (root / "sub" / "b c.png").write_bytes(IMAGE)
    (out / "secret.png").write_bytes(IMAGE)
    (root / "inside.png").symlink_to(root / "a.png")  # a symlink that stays inside
    (root / "out.png").symlink_to(out / "secret.png")  # a symlink out
    (root / "outdir").symlink_to(out, target_is_directory=True)
    os.mkfifo(root / "fifo")
    return root, out


def _limits(root: Path | None, max_bytes: int = 1 << 20) -> ImageLimits:
    return ImageLimits(max_bytes, 1 << 24, local_media_root=root)


def _read(url: str, lim: ImageLimits) -> bytes:
    return image_bytes(ImageInput(url=url), FIELD, lim)


def test_file_urls_are_refused_by_default(media):
    root, _ = media
    with pytest.raises(ChatError) as e:
        _read(f"file://{root}/a.png", _limits(None))
    assert e.value.field == FIELD and "allowed_local_media_path is unset" in e.value.message
    assert e.value.code == "INVALID_ARGUMENT"
    assert EncoderConfig.model_fields["allowed_local_media_path"].default == ""
    assert local_media_root("") is None


def test_a_file_under_the_allowed_path_is_read(media):
    root, _ = media
    lim = _limits(local_media_root(str(root)))
    for url in (f"file://{root}/a.png", f"file://localhost{root}/a.png",
                f"file://{root}/sub/b%20c.png", f"file://{root}/inside.png",
                f"file://{root}/sub/../a.png"):
        assert _read(url, lim) == IMAGE, url


@pytest.mark.parametrize("where,text", [
    ("{out}/secret.png", "outside the encoder's allowed_local_media_path"),
    ("{out}/missing.png", "outside the encoder's allowed_local_media_path"),
    ("{root}/../private/secret.png", "outside the encoder's allowed_local_media_path"),
    ("{root}/out.png", "outside the encoder's allowed_local_media_path"),  # symlink out
    ("{root}/outdir/secret.png", "outside the encoder's allowed_local_media_path"),
    ("/etc/passwd", "outside the encoder's allowed_local_media_path"),
    ("{root}/missing.png", "no readable file"),
    ("{root}/sub", "no regular file"),
    ("{root}/fifo", "no regular file"),
])
def test_a_file_outside_or_not_a_file_is_refused(media, where, text):
    root, out = media
    with pytest.raises(ChatError) as e:
        _read("file://" + where.format(root=root, out=out), _limits(local_media_root(str(root))))
    assert (e.value.field, e.value.code) == (FIELD, "INVALID_ARGUMENT")
    assert text in e.value.message, e.value.message


def test_a_file_url_with_a_host_or_query_is_refused(media):
    root, _ = media
    for url in (f"file://example.com{root}/a.png", f"file://{root}/a.png?x=1", "file:a.png"):
        with pytest.raises(ChatError) as e:
            _read(url, _limits(local_media_root(str(root))))
        assert "file:///<absolute path>" in e.value.message, url


def test_the_byte_cap_is_a_data_urls(media):
    root, _ = media
    lim = _limits(local_media_root(str(root)), max_bytes=len(IMAGE) - 1)
    with pytest.raises(ChatError) as e:
        _read(f"file://{root}/a.png", lim)
    data_url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    with pytest.raises(ChatError) as d:
        _read(data_url, lim)
    for err in (e.value, d.value):  # the same limit, named the same way
        assert err.field == FIELD and f"over the limit of {len(IMAGE) - 1}" in err.message


def test_videos_and_frames_read_file_urls_too(media):
    root, out = media
    lim = _limits(local_media_root(str(root)))
    rules = SourceRules("video", 1 << 20)
    assert source_bytes(None, f"file://{root}/a.png", "v", lim, rules) == IMAGE
    with pytest.raises(ChatError):
        source_bytes(None, f"file://{root}/out.png", "v", lim, rules)
    frames = (ImageInput(url=f"file://{root}/a.png"), ImageInput(url=f"file://{root}/inside.png"))
    planned = plan_frames_source(frames, VideoSettings.defaults("qwen2_vl"),
                                 VideoOptions(fps=2.0), VideoLimits(), lim, "v.frames")
    assert planned.frames == (IMAGE, IMAGE)
    with pytest.raises(ChatError) as e:
        plan_frames_source(frames[:1] + (ImageInput(url=f"file://{out}/secret.png"),),
                           VideoSettings.defaults("qwen2_vl"), VideoOptions(fps=2.0),
                           VideoLimits(), lim, "v.frames")
    assert e.value.field == "v.frames[1]"


def test_the_encoder_refuses_to_start_on_a_path_that_is_no_directory(media):
    root, _ = media
    for bad in (str(root / "a.png"), str(root / "nowhere")):
        with pytest.raises(ValueError, match="allowed_local_media_path"):
            local_media_root(bad)


def test_tandem_serve_maps_the_flag_onto_the_encoder(media):
    root, _ = media
    launch = serve.translate_launch(["m", "--allowed-local-media-path", str(root)])
    assert launch.tier[To.ENCODER] == ["--allowed-local-media-path", str(root)]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_file_image_encodes_exactly_as_the_same_image_as_a_data_url(checkpoint, media):
    root, _ = media
    pipe = EncodePipeline.from_config(EncoderConfig(
        model=str(checkpoint("qwen2_5_vl")), device="cpu", dtype="float32",
        linear_backend="torch", allowed_local_media_path=str(root)))
    data_url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()

    def chat(url: str) -> list[Message]:
        return [Message("user", ("Describe", ImageInput(url=url), "briefly."))]

    async def both():
        pipe.start()
        try:
            return (await pipe.encode(EncodeJob(chat(f"file://{root}/sub/b%20c.png"))),
                    await pipe.encode(EncodeJob(chat(data_url))))
        finally:
            await pipe.stop()

    by_file, by_data = asyncio.run(both())
    got, want = by_file.payload, by_data.payload
    assert by_file.image_hashes == by_data.image_hashes
    assert torch.equal(got.fill_ids, want.fill_ids)
    assert torch.equal(got.input_embeds, want.input_embeds)
    assert torch.equal(got.mrope_positions, want.mrope_positions)
