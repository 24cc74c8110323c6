"""Tiny text encoders and vision encoders shared by the tiny pipelines (the VAEs are in :mod:`.vaes`).

Every builder returns a randomly initialised float32 model in eval mode with hidden sizes of 8 to 32 and two
layers, so that a whole pipeline runs in about a second on a CPU. Builders take the tokenizer they will be paired
with, because the vocabulary size and the special token ids (pad, end of text, vision tokens) must agree with it.

Randomness: callers wrap each builder in :func:`seeded`, which seeds a private copy of the global RNG so that
building the same component twice with the same seed gives identical weights, and building it does not disturb
the caller's random state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with the CPU RNG seeded to ``seed``, restoring the caller's RNG state afterwards.

    Model constructors draw their initial weights from the global RNG; forking it keeps the zoo deterministic
    without side effects on the code that builds it. Only the CPU generator is forked (``devices=[]``): the
    tiny models are always built on the CPU and no accelerator runtime is touched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def finish(model: torch.nn.Module) -> torch.nn.Module:
    """Put a freshly built model in inference form: eval mode, without gradients, float32 throughout."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise TypeError(f"{type(model).__name__} was not built in float32 (is the default dtype changed?)")
    model.eval()
    model.requires_grad_(False)
    return model


def _token_ids(tokenizer) -> dict[str, int | None]:
    """The special token ids a text-model config needs, read from the paired tokenizer."""
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


# --------------------------------------------------------------------------------------------------------------
# Text encoders of the Qwen family
# --------------------------------------------------------------------------------------------------------------


def _qwen_text_config(tokenizer, hidden_size: int = 16, num_layers: int = 2, head_dim: int = 8) -> dict:
    return {
        **_token_ids(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": hidden_size // head_dim,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
    }


def _vision_token_ids(tokenizer) -> dict[str, int]:
    return {
        "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    }


def _qwen_vision_config(out_hidden_size: int, **extra) -> dict:
    """A Qwen-VL vision tower of two 16-wide blocks with two heads, projecting into the text width."""
    return {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": out_hidden_size,
        **extra,
    }


def qwen2_5_vl(tokenizer, hidden_size: int = 16):
    """``Qwen2_5_VLForConditionalGeneration`` (QwenImage, LongCat-Image): 2 text layers, a 2-block vision tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = 8
    text = _qwen_text_config(tokenizer, hidden_size=hidden_size, head_dim=head_dim)
    # Multimodal RoPE splits head_dim / 2 rotary frequencies over (time, height, width).
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=_qwen_vision_config(hidden_size, fullatt_block_indexes=[1]),
        **_vision_token_ids(tokenizer),
    )
    return finish(Qwen2_5_VLForConditionalGeneration(config))


def qwen3(tokenizer, hidden_size: int = 16):
    """``Qwen3Model`` (Ovis-Image's text encoder is the bare decoder, without an LM head)."""
    from transformers import Qwen3Config, Qwen3Model

    return finish(Qwen3Model(Qwen3Config(**_qwen_text_config(tokenizer, hidden_size=hidden_size))))


def qwen3_vl(tokenizer, hidden_size: int = 16):
    """``Qwen3VLForConditionalGeneration`` (JoyImage-Edit): 2 text layers and a 2-block vision tower.

    The vision tower reads 16-pixel patches merged 2x2, so a 32x32 reference image becomes one vision token.
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = _qwen_text_config(tokenizer, hidden_size=hidden_size)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [1, 1, 2],
        "mrope_interleaved": True,
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=_qwen_vision_config(hidden_size, num_position_embeddings=16, deepstack_visual_indexes=[1]),
        **_vision_token_ids(tokenizer),
    )
    return finish(Qwen3VLForConditionalGeneration(config))


@functools.lru_cache(maxsize=None)
def _without_video(processor_cls: type) -> type:
    """A subclass of a Qwen-VL processor class that accepts ``video_processor=None``.

    transformers' video processors require torchvision, which the test environment does not have. The
    pipelines only send text and images through their processors, so the video half is left out; everything
    else (image patching, expansion of ``<|image_pad|>``, tokenisation) is the unchanged upstream code.
    """

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return type(None)
        return processor_cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(
        f"{processor_cls.__name__}WithoutVideo",
        (processor_cls,),
        {"check_argument_for_proper_class": check_argument_for_proper_class, "__module__": __name__},
    )


def _qwen_vl_processor(processor_cls_name: str, tokenizer, patch_size: int):
    import transformers

    # Two patches by two patches (merged into one vision token): the tiny reference images are 32x32.
    pixels = (2 * patch_size) ** 2
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": pixels, "longest_edge": pixels},
    )
    processor_cls = _without_video(getattr(transformers, processor_cls_name))
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


def qwen3_vl_processor(tokenizer):
    """A ``Qwen3VLProcessor`` (16-pixel patches) around ``tokenizer``, for JoyImage-Edit's image+text prompts."""
    return _qwen_vl_processor("Qwen3VLProcessor", tokenizer, patch_size=16)


def qwen2_vl_processor(tokenizer):
    """A ``Qwen2VLProcessor`` (14-pixel patches): LongCat-Image keeps one for its optional prompt rewriting."""
    return _qwen_vl_processor("Qwen2VLProcessor", tokenizer, patch_size=14)


# --------------------------------------------------------------------------------------------------------------
# Other text encoders
# --------------------------------------------------------------------------------------------------------------


def mistral3(tokenizer, hidden_size: int = 16, num_layers: int = 2):
    """``Mistral3ForConditionalGeneration`` (Flux2): a ``num_layers``-layer Mistral text model and a 1-layer
    Pixtral tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = _token_ids(tokenizer)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            **ids,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": hidden_size // 2,
            "max_position_embeddings": 2048,
            "sliding_window": None,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "image_size": 32,
            "patch_size": 8,
            "num_channels": 3,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        vision_feature_layer=-1,
        **{k: v for k, v in ids.items() if k != "vocab_size"},
    )
    return finish(Mistral3ForConditionalGeneration(config))


def _clip_text_config(tokenizer, hidden_size: int, projection_dim: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=projection_dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_act="gelu",
    )


def clip_text(tokenizer, hidden_size: int = 16, projection_dim: int = 16):
    """``CLIPTextModel`` (SDXL's first text encoder)."""
    from transformers import CLIPTextModel

    return finish(CLIPTextModel(_clip_text_config(tokenizer, hidden_size, projection_dim)))


def clip_text_with_projection(tokenizer, hidden_size: int = 16, projection_dim: int = 16):
    """``CLIPTextModelWithProjection`` (SDXL's second and SD3's two CLIP encoders: they give a pooled embedding)."""
    from transformers import CLIPTextModelWithProjection

    return finish(CLIPTextModelWithProjection(_clip_text_config(tokenizer, hidden_size, projection_dim)))


def _t5_config(cls_config, tokenizer, d_model: int):
    return cls_config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=d_model // 8,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def t5_encoder(tokenizer, d_model: int = 32):
    """``T5EncoderModel`` (SD3's third text encoder)."""
    from transformers import T5Config, T5EncoderModel

    return finish(T5EncoderModel(_t5_config(T5Config, tokenizer, d_model)))


def umt5_encoder(tokenizer, d_model: int = 16):
    """``UMT5EncoderModel`` (Wan)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return finish(UMT5EncoderModel(_t5_config(UMT5Config, tokenizer, d_model)))


def _decoder_config(tokenizer, hidden_size: int, num_layers: int, head_dim: int = 8) -> dict:
    """A small decoder-only text config (Gemma, Llama, GLM) sized to ``tokenizer``."""
    return {
        **_token_ids(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "max_position_embeddings": 512,
    }


def gemma2(tokenizer, hidden_size: int = 16, num_layers: int = 2):
    """``Gemma2Model`` (Sana, Lumina 2)."""
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(**_decoder_config(tokenizer, hidden_size, num_layers), sliding_window=16)
    return finish(Gemma2Model(config))


def llama(tokenizer, hidden_size: int = 16, num_layers: int = 2, causal_lm: bool = False):
    """``LlamaModel`` (HunyuanVideo), or ``LlamaForCausalLM`` with ``causal_lm`` (HiDream)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(**_decoder_config(tokenizer, hidden_size, num_layers))
    return finish((LlamaForCausalLM if causal_lm else LlamaModel)(config))


def glm(tokenizer, hidden_size: int = 16, num_layers: int = 2):
    """``GlmModel`` (CogView4)."""
    from transformers import GlmConfig, GlmModel

    return finish(GlmModel(GlmConfig(**_decoder_config(tokenizer, hidden_size, num_layers))))


def bert(tokenizer, hidden_size: int = 16):
    """``BertModel`` (HunyuanDiT's CLIP-like bilingual encoder)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    return finish(BertModel(config))
