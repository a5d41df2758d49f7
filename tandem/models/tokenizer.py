"""An offline byte-level BPE tokenizer with the Qwen family's special tokens.

Trained with `tokenizers` on a corpus shipped here (English plus multi-byte UTF-8: accents,
CJK, emoji), so no download is needed. The corpus is small on purpose: multi-byte characters
it lacks stay split over several byte tokens, which exercises streaming detokenization.
Tests rely on it: 🙂 (and ꙮ) are kept out of the corpus and always take several tokens.

Vocabulary layout (ids are fixed by construction; `BASE_VOCAB` BPE entries, then specials):

    0 .. BASE_VOCAB-1              byte-level BPE (256 byte symbols + merges)
    BASE_VOCAB + i                 SPECIAL_TOKENS[i]  (<|endoftext|> first, as in Qwen)

Unlike the released models, the embedding has no padding rows above the tokenizer
(VOCAB_SIZE == BASE_VOCAB + len(SPECIAL_TOKENS)): a random-weight model then never emits an
id that has no token.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BASE_VOCAB = 998
VOCAB_SIZE = 1024  # embedding rows (== BASE_VOCAB + len(SPECIAL_TOKENS))

# Qwen2.5-VL / Qwen3-VL order; the last four are Qwen3's (plain added tokens there too).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# Tokens that `skip_special_tokens` removes (Qwen marks the tool/think tags as non-special).
_NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}
assert BASE_VOCAB + len(SPECIAL_TOKENS) == VOCAB_SIZE
TOKEN_IDS = {tok: BASE_VOCAB + i for i, tok in enumerate(SPECIAL_TOKENS)}
ENDOFTEXT_ID = TOKEN_IDS["<|endoftext|>"]
IM_START_ID = TOKEN_IDS["<|im_start|>"]
IM_END_ID = TOKEN_IDS["<|im_end|>"]
VISION_START_ID = TOKEN_IDS["<|vision_start|>"]
VISION_END_ID = TOKEN_IDS["<|vision_end|>"]
IMAGE_PAD_ID = TOKEN_IDS["<|image_pad|>"]
VIDEO_PAD_ID = TOKEN_IDS["<|video_pad|>"]

# Qwen2's pre-tokenizer split (the same regex transformers' Qwen2Tokenizer uses).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe the image in one sentence. What is shown in this picture? There are two cats
sleeping on a red sofa near the window, and the afternoon light falls across the floor.
The system serves vision-language models: an encoder turns images into embeddings, and a
language model generates text token by token. Requests arrive, wait in a queue, and leave
when the answer is complete. Each token costs time; batching many requests together makes
the hardware busy and the throughput high. Latency matters to people who wait for answers.
You are a helpful assistant. Please answer the question briefly and precisely.
User: How many apples are on the table? Assistant: I can see three green apples and one
yellow pear on a wooden table. User: What colour is the car? Assistant: The car is blue.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1e-6 -17 +8 50% $12.99 #7 @home.
Code: def forward(self, x): return self.proj(x) + x  # residual
for i in range(10): print(i, i * i)  if a == b and c != d: pass
{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello"}]}
Weather report: cloudy in the morning, sunny in the afternoon, rain expected at night.
She said, "It's fine, we'll manage; they've done it before and I'd do it again."
Café au lait, crème brûlée, naïve façade, déjà vu, piñata, Übermäßig, smørrebrød, ångström.
Élan vital: l'été à Paris est très chaud; à bientôt, señor García. Straße, Größe, Ærø.
中文测试：今天天气很好，我们去公园散步。图片里有一只猫和一只狗。你好，世界！
日本語のテキスト：こんにちは、世界。東京は大きな都市です。
한국어 문장: 안녕하세요, 만나서 반갑습니다.
Русский текст: привет, мир! Ελληνικά: γεια σου κόσμε. العربية: مرحبا بالعالم. עברית: שלום.
Emoji: 😀 😂 🎉 🚀 🐱 🐶 🌍 ❤️ 👍🏽 👨‍👩‍👧 🇯🇵 — mixed with text and symbols ™ © ® ° ± × ÷ € £ ¥.
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π θ λ μ σ Ω → ⇒ ∀ ∃ ∈ ∉ ∪ ∩.
Tabs\tand\tnewlines\n are whitespace; so are   multiple   spaces.
The image shows a mountain lake at sunrise. Snow covers the peaks, pine trees line the
shore, and a small wooden boat is tied to the dock. Birds fly low over the calm water.
A street scene at night: neon signs, wet pavement reflecting lights, people with umbrellas
crossing the road, a yellow taxi waiting at the traffic light, and a cyclist in a hurry.
In the kitchen there is a pot of soup on the stove, bread on the board, and a bowl of
oranges. The recipe needs flour, sugar, butter, eggs, milk, salt and a pinch of cinnamon.
Machine learning models learn patterns from data. Attention lets every token look at the
others; rotary position embeddings encode where each token sits in the sequence.
"""


def train_tokenizer() -> Tokenizer:
    """The byte-level BPE tokenizer (deterministic: same corpus, same merges and ids)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # Repeat the corpus so merge counts are well separated (ties are resolved deterministically
    # by tokenizers anyway).
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 3, trainer=trainer)
    if tok.get_vocab_size() != BASE_VOCAB:
        raise RuntimeError(f"BPE vocab is {tok.get_vocab_size()}, expected {BASE_VOCAB}")
    return tok


def vocab_and_merges(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE model's vocabulary and ordered merges, as Qwen2Tokenizer takes them."""
    import json

    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def is_special(token: str) -> bool:
    return token not in _NOT_SPECIAL


# The part both Qwen chat templates share: counters, then a list-valued message's parts
# (images as vision_start/image_pad/vision_end, videos with video_pad, text as is).
_COUNTERS = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
_CONTENT_PARTS = (
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
)

# A message's content, a string or parts (the current `message`).
_CONTENT = "{% if message['content'] is string %}{{ message['content'] }}{% else %}" + _CONTENT_PARTS + "{% endif %}"

# Tools as Qwen's templates render them: a system block listing the functions, assistant
# calls as <tool_call>{"name", "arguments"}</tool_call>, tool results as a user turn of
# <tool_response> blocks (consecutive results share one turn).
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
_TOOL_TURNS = (
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n" + _CONTENT + "\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n" + _CONTENT
    + "{% for call in message['tool_calls'] or [] %}\n<tool_call>\n"
    '{"name": "{{ call[\'name\'] }}", "arguments": {{ call[\'arguments\'] }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}"
)


def _with_tools(default_system: str) -> str:
    """Both Qwen templates: `default_system` opens a chat that has no system message."""
    first_system = (
        "{% if messages[0]['role'] == 'system' %}{% set message = messages[0] %}" + _CONTENT
        + "\n\n{% else %}" + (default_system + "\n\n" if default_system else "")
        + "{% endif %}"
    )
    return (
        _COUNTERS
        + "{% if tools %}<|im_start|>system\n" + first_system + _TOOLS_HEADER + "{% endif %}"
        "{% for message in messages %}"
        "{% if tools and loop.first and message['role'] == 'system' %}"
        + ("{% elif loop.first and message['role'] != 'system' and not tools %}"
           "<|im_start|>system\n" + default_system + "<|im_end|>\n"
           "<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n"
           if default_system else "")
        + _TOOL_TURNS
        + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ).replace("%}\n", "%}{{ '\\n' }}")  # NOTE: transformers renders with trim_blocks on


# Qwen2.5-VL's chat template (default system prompt; images as vision_start/image_pad/
# vision_end), with Qwen2.5's tool-calling branches.
CHAT_TEMPLATE_QWEN2_5 = _with_tools("You are a helpful assistant.")

# Qwen3-VL's chat template (no default system prompt), with its tool-calling branches.
CHAT_TEMPLATE_QWEN3 = _with_tools("")
