"""Image-only Qwen processors, so `AutoProcessor` works without torchvision.

The stock `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` take a video processor, and every video
processor in transformers needs torchvision, which does not import beside the CPU torch here.
The subclasses below drop `video_processor` from `__init__`'s signature (transformers derives
a processor's parts from that signature), so loading builds only the tokenizer and the
(PIL) image processor. Everything else, including `mm_token_type_ids` in the output (which
`get_rope_index` needs), is the stock behaviour.

The subclasses keep the stock class names, so a checkpoint they save names the stock class
and loads with plain transformers wherever torchvision exists.

`register()` is called by the import hook in `tandem/models/hook.py` as soon as transformers'
processor auto-mapping is imported; it is idempotent.
"""

from __future__ import annotations

from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl import processing_qwen2_5_vl
from transformers.models.qwen3_vl import processing_qwen3_vl
from transformers.utils import is_torchvision_available


class ImageOnlyQwen2_5_VLProcessor(processing_qwen2_5_vl.Qwen2_5_VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # ProcessorMixin pairs positional parts with get_attributes() (image_processor,
        # tokenizer): the trailing None for the video processor is dropped there.
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyQwen3VLProcessor(processing_qwen3_vl.Qwen3VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


# Saved `processor_class` names stay the stock ones.
ImageOnlyQwen2_5_VLProcessor.__name__ = "Qwen2_5_VLProcessor"
ImageOnlyQwen3VLProcessor.__name__ = "Qwen3VLProcessor"

PROCESSORS = {
    Qwen2_5_VLConfig: (ImageOnlyQwen2_5_VLProcessor, "qwen2_5_vl"),
    Qwen3VLConfig: (ImageOnlyQwen3VLProcessor, "qwen3_vl"),
}

_registered = False


def register() -> None:
    """Make `AutoProcessor` build the image-only processors (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    import importlib

    for config_cls, (proc_cls, package) in PROCESSORS.items():
        # Checkpoints without a `processor_class` resolve through the config type.
        AutoProcessor.register(config_cls, proc_cls, exist_ok=True)
        if not is_torchvision_available():
            # NOTE: checkpoints that name the stock class (every real one: "Qwen2_5_VLProcessor")
            # are resolved by `getattr(transformers.models.<package>, name)`; the stock class
            # cannot be built without torchvision, so that name points at the image-only one.
            module = importlib.import_module(f"transformers.models.{package}")
            setattr(module, proc_cls.__name__, proc_cls)
