"""Tokenizers built entirely in code, for the tiny pipelines.

Nothing may be downloaded in the test environment, so every tokenizer a tiny pipeline needs is constructed
here from a small, fixed vocabulary. Each one is a real instance of the class the pipeline expects (Qwen2,
CLIP, T5, or a generic fast tokenizer), so the pipelines run their ordinary tokenisation code paths: chat
templates, special tokens, padding and truncation.

The vocabularies are byte-level (any text can be encoded, nothing maps to "unknown") plus whole-word merges
for a short list of common words, so that prompts and prompt templates tokenize to roughly as many tokens as
they would with the real tokenizers. The token ids are fixed by construction: building a tokenizer twice
gives identical ids.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

# Words that get a whole-word token. They cover the prompt templates of the pipelines in the zoo and the
# prompts the tests use; any other text still encodes, byte by byte.
_COMMON_TEXT = """
a an the of and or to in on at by for with from is are be this that it its as not no
describe image images video videos detailing color colour shape size texture quantity text spatial
relationships objects object background prompt caption captioning expert generate generated descriptive
suitable input model content based user assistant system helpful who will give photo picture
cat dog sitting bench dancing red blue green car tree house sky sunset astronaut riding horse
bad quality low blurry seconds long fps resolution frames you are
"""

# The byte-level alphabet (the 256 printable stand-ins that GPT-2 style tokenizers use for raw bytes),
# sorted so that the ids do not depend on set iteration order.
_BYTE_ALPHABET: tuple[str, ...] = tuple(sorted(pre_tokenizers.ByteLevel.alphabet()))
_SPACE = "\u0120"  # "Ġ": how byte-level BPE writes a leading space


def common_words() -> tuple[str, ...]:
    """The fixed word list that gets whole-word tokens (lower case and capitalised), in a stable order."""
    words = re.findall(r"[a-z]+", _COMMON_TEXT)
    return tuple(dict.fromkeys(words + [w.capitalize() for w in words]))


def _chain_merges(piece: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Add the left-to-right merges that build ``piece`` one symbol at a time (the ids are appended)."""
    for i in range(1, len(piece)):
        left, right = piece[:i], piece[i]
        merged = left + right
        if merged not in vocab:
            vocab[merged] = len(vocab)
            merges.append((left, right))


@lru_cache(maxsize=None)
def _byte_level_vocab(special_tokens: tuple[str, ...]) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Byte-level BPE vocabulary and merges: the 256 byte symbols, whole-word merges, then special tokens."""
    vocab = {symbol: i for i, symbol in enumerate(_BYTE_ALPHABET)}
    merges: list[tuple[str, str]] = []
    for word in common_words():
        _chain_merges(word, vocab, merges)
        _chain_merges(_SPACE + word, vocab, merges)
    for token in special_tokens:
        if token not in vocab:
            vocab[token] = len(vocab)
    return vocab, tuple(merges)


# ChatML, the template of the Qwen family (content may be a string or a list of typed parts).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def qwen2_tokenizer(extra_special_tokens: tuple[str, ...] = ()):
    """A real ``Qwen2Tokenizer`` (byte-level BPE) with the ChatML template and the Qwen-VL vision tokens.

    ``<|endoftext|>`` is the pad and end token, as in the released Qwen checkpoints.
    """
    from transformers import Qwen2Tokenizer

    specials = QWEN_SPECIAL_TOKENS + tuple(extra_special_tokens)
    vocab, merges = _byte_level_vocab(specials)
    tokenizer = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        extra_special_tokens=list(specials[1:]),
        model_max_length=4096,
    )
    # Whole words in the vocabulary are used as they are; merges only apply to the other words.
    tokenizer.backend_tokenizer.model.ignore_merges = True
    tokenizer.chat_template = CHATML_TEMPLATE
    # Qwen-VL processors look these up by attribute name.
    tokenizer.image_token = "<|image_pad|>"
    tokenizer.video_token = "<|video_pad|>"
    tokenizer.vision_start_token = "<|vision_start|>"
    tokenizer.vision_end_token = "<|vision_end|>"
    return tokenizer


# Mistral's instruct format: an optional system prompt, then [INST] ... [/INST].
MISTRAL_TEMPLATE = (
    "<s>"
    "{% for message in messages %}"
    "{% set text = message['content'] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}</s>{% endif %}"
    "{% endfor %}"
)

MISTRAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
)


def mistral_tokenizer():
    """A byte-level fast tokenizer with Mistral's special tokens and instruct chat template.

    Flux2 only needs ``apply_chat_template`` (batched, padded to a fixed length) from its "processor", which
    a fast tokenizer provides; the image branch of the Pixtral processor is never used for text-to-image.
    """
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _byte_level_vocab(MISTRAL_SPECIAL_TOKENS)
    backend = Tokenizer(BPE(vocab=dict(vocab), merges=list(merges), fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=list(MISTRAL_SPECIAL_TOKENS[4:]),
        model_max_length=4096,
    )
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


@lru_cache(maxsize=None)
def _clip_vocab() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """CLIP's BPE marks the end of a word with ``</w>``: every byte symbol exists with and without it."""
    vocab: dict[str, int] = {}
    for symbol in _BYTE_ALPHABET:
        vocab[symbol] = len(vocab)
    for symbol in _BYTE_ALPHABET:
        vocab[symbol + "</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in common_words():
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            merged = current + piece
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((current, piece))
            current = merged
    for token in ("<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    return vocab, tuple(merges)


def clip_tokenizer(model_max_length: int = 77):
    """A real ``CLIPTokenizer``; ``model_max_length`` is the padded prompt length the SD pipelines use."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab()
    tokenizer = CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length)
    tokenizer.backend_tokenizer.model.ignore_merges = True
    return tokenizer


def t5_tokenizer(model_max_length: int = 512):
    """A real ``T5Tokenizer`` (Unigram): whole common words score higher than spelling them out."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    letters = [chr(c) for c in range(33, 127)]
    pieces += [(ch, -8.0) for ch in letters]
    pieces += [("\u2581" + ch, -8.0) for ch in letters]
    pieces += [("\u2581" + word, -4.0) for word in common_words()]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


@lru_cache(maxsize=None)
def _sentencepiece_vocab(special_tokens: tuple[str, ...]) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """A SentencePiece-style BPE vocabulary (``▁`` marks a leading space): the special tokens first,
    then ``▁`` and printable ASCII, then whole-word merges of the common words."""
    vocab = {token: i for i, token in enumerate(special_tokens)}
    for symbol in ["\u2581"] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(symbol, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in common_words():
        _chain_merges("\u2581" + word, vocab, merges)
    return vocab, tuple(merges)


def gemma_tokenizer():
    """A real ``GemmaTokenizer`` (Sana's and Lumina 2's Gemma 2 encoders); ``<pad>`` is id 0."""
    from transformers import GemmaTokenizer

    vocab, merges = _sentencepiece_vocab(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))
    return GemmaTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=4096)


def llama_tokenizer():
    """A real ``LlamaTokenizer`` (HunyuanVideo's and HiDream's Llama encoders), with ``<pad>`` added:
    the pipelines pad prompts to a fixed length."""
    from transformers import LlamaTokenizer

    vocab, merges = _sentencepiece_vocab(("<unk>", "<s>", "</s>", "<pad>"))
    return LlamaTokenizer(vocab=dict(vocab), merges=list(merges), pad_token="<pad>", model_max_length=4096)


def bert_tokenizer():
    """A real ``BertTokenizer`` (WordPiece, lower case): HunyuanDiT's bilingual CLIP-like encoder."""
    from transformers import BertTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = specials + [chr(c) for c in range(33, 127)] + ["##" + chr(c) for c in range(33, 127)]
    pieces += [w for w in common_words() if w.islower()]
    return BertTokenizer(vocab={piece: i for i, piece in enumerate(dict.fromkeys(pieces))}, model_max_length=512)


def byte_level_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``<s>``, ``</s>`` and ``<pad>``: for encoders
    whose pipelines only tokenise, pad and truncate (CogView4's GLM)."""
    from transformers import PreTrainedTokenizerFast

    specials = ("<unk>", "<s>", "</s>", "<pad>")
    vocab, merges = _byte_level_vocab(specials)
    backend = Tokenizer(BPE(vocab=dict(vocab), merges=list(merges), fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=4096,
    )
