"""Stand-ins for architectures that diffusers does not ship (docs/models.md).

NextStep-1.1, BAGEL and the upstream split of Cosmos 3 into a video foundation model (VFM) and a language model
are not diffusers classes, but the supported-model table names them. The offloader recognises models by class
name, so each stand-in here is a small ``torch.nn.Module`` with the *same class name* and the same topology
(where the blocks live, what lives outside them, how they are called), with random weights.

They also carry the awkward features that real checkpoints have and that an offloader must preserve:

- ``NextStepModel``: the LM head is tied to the token embedding, both *outside* the blocks; every decoder
  layer owns a rotary ``inv_freq`` buffer registered with ``persistent=False`` (absent from the state dict).
- ``Qwen2MoTModel``: each layer holds two experts, "understanding" (float32) and "generation" (bfloat16,
  cast to the activation dtype where used), chosen per token by a mask; customised modules (``vae2llm``,
  ``time_embedder``, ``llm2vae``) and a bare parameter (``latent_pos_embed``) live outside the layers.
- ``Cosmos3VFMTransformer``: a DiT with adaLN modulation from the timestep; each block's modulation table is
  a non-contiguous (transposed) parameter.
- ``Cosmos3LanguageModel``: two block lists. ``layers`` (understanding pathway) run first over the text and
  leave their keys and values; ``gen_layers`` (generation pathway) then run over the vision tokens, attending
  to the text keys and values of the same depth.
- ``SDXLUNet2DConditionModel``: diffusers' ``UNet2DConditionModel`` under the name other SDXL code uses.

Every forward is deterministic on the CPU (no dropout, no random sampling).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offload_core.tiny.encoders import seeded
from offload_core.tiny.transformers import CONFIGS

from denoisers import TinySpec, _input_generator, _inputs_sdxl_unet

# --------------------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding; ``inv_freq`` is a non-persistent buffer (recomputed, never saved)."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: (batch, heads, seq, head_dim); ``cos``/``sin``: (seq, head_dim)."""
    return x * cos + _rotate_half(x) * sin


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weights may be stored in a lower precision than the activations: compute in the activation dtype.
        gate = F.linear(x, self.gate_proj.weight.to(x.dtype))
        up = F.linear(x, self.up_proj.weight.to(x.dtype))
        return F.linear(F.silu(gate) * up, self.down_proj.weight.to(x.dtype))


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)."""
    b, s, d = x.shape
    return x.view(b, s, num_heads, d // num_heads).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def _rotary_qkv(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Queries, keys and values of ``x`` from ``attn.q_proj``/``k_proj``/``v_proj``, split into ``attn.num_heads``
    heads, with the rotary embedding applied to the queries and keys."""
    q = _apply_rotary(_heads(attn.q_proj(x), attn.num_heads), cos, sin)
    k = _apply_rotary(_heads(attn.k_proj(x), attn.num_heads), cos, sin)
    v = _heads(attn.v_proj(x), attn.num_heads)
    return q, k, v


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal timestep features, (batch,) -> (batch, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None, :]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 16):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(_timestep_embedding(t, self.freq_dim))))


# --------------------------------------------------------------------------------------------------------------
# NextStep-1.1: a decoder-only LM over text and continuous image tokens
# --------------------------------------------------------------------------------------------------------------


class NextStepAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=True)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = _rotary_qkv(self, x, cos, sin)
        return self.o_proj(_merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class NextStepDecoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = NextStepAttention(dim, num_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_dim)
        # Each layer keeps its own rotary table, as a non-persistent buffer.
        self.rotary_emb = RotaryEmbedding(dim // num_heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class NextStepModel(nn.Module):
    """NextStep-1.1's autoregressive backbone: embedding, ``layers``, final norm, tied LM head, image head."""

    def __init__(self, vocab_size: int = 64, dim: int = 16, num_layers: int = 2, num_heads: int = 2,
                 mlp_dim: int = 32, latent_dim: int = 4):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.image_in_projector = nn.Linear(latent_dim, dim)
        self.layers = nn.ModuleList([NextStepDecoderLayer(dim, num_heads, mlp_dim) for _ in range(num_layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied, outside the blocks
        self.image_head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, latent_dim))

    def forward(self, input_ids: torch.Tensor, image_latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Text tokens then continuous image tokens; returns (text logits, next-image-token predictions)."""
        x = torch.cat([self.embed_tokens(input_ids), self.image_in_projector(image_latents)], dim=1)
        positions = torch.arange(x.shape[1])
        for layer in self.layers:
            x = layer(x, positions)
        x = self.norm(x)
        num_text = input_ids.shape[1]
        return self.lm_head(x[:, :num_text]), self.image_head(x[:, num_text:])


def _build_nextstep(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    with seeded(seed):
        model = NextStepModel().eval()
    g = _input_generator(seed)
    inputs = {
        "input_ids": torch.randint(0, 64, (1, 6), generator=g),
        "image_latents": torch.randn(1, 4, 4, generator=g),
    }
    return model, inputs


# --------------------------------------------------------------------------------------------------------------
# BAGEL: Qwen2 mixture-of-transformers (an understanding and a generation expert per layer)
# --------------------------------------------------------------------------------------------------------------


class Qwen2MoTAttention(nn.Module):
    """Joint attention over all tokens; each token's projections come from its own expert."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        for suffix in ("", "_moe_gen"):
            setattr(self, f"q_proj{suffix}", nn.Linear(dim, dim, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(dim, dim, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(dim, dim, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(dim, dim, bias=False))

    @staticmethod
    def _route(x: torch.Tensor, gen_mask: torch.Tensor, und: nn.Linear, gen: nn.Linear) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], und.out_features)
        out[~gen_mask] = und(x[~gen_mask])
        out[gen_mask] = gen(x[gen_mask])
        return out

    def forward(self, x, gen_mask, cos, sin):
        q = self._route(x, gen_mask, self.q_proj, self.q_proj_moe_gen)
        k = self._route(x, gen_mask, self.k_proj, self.k_proj_moe_gen)
        v = self._route(x, gen_mask, self.v_proj, self.v_proj_moe_gen)
        q = _apply_rotary(_heads(q, self.num_heads), cos, sin)
        k = _apply_rotary(_heads(k, self.num_heads), cos, sin)
        # Text tokens see the text before them; generation tokens see the text and every generation token.
        seq = x.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = (causal[None] | (gen_mask[:, :, None] & gen_mask[:, None, :]))[:, None]  # (batch, 1, seq, seq)
        attn = _merge_heads(F.scaled_dot_product_attention(q, k, _heads(v, self.num_heads), attn_mask=allowed))
        return self._route(attn, gen_mask, self.o_proj, self.o_proj_moe_gen)


class Qwen2MoTDecoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, gen_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.input_layernorm_moe_gen = RMSNorm(dim)
        self.self_attn = Qwen2MoTAttention(dim, num_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.post_attention_layernorm_moe_gen = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_dim)
        # The generation expert's MLP is stored in bfloat16 next to float32 weights in the same block.
        self.mlp_moe_gen = SwiGLU(dim, mlp_dim, dtype=gen_dtype)

    @staticmethod
    def _per_expert(x, gen_mask, und, gen):
        out = torch.empty_like(x)
        out[~gen_mask] = und(x[~gen_mask])
        out[gen_mask] = gen(x[gen_mask])
        return out

    def forward(self, x, gen_mask, cos, sin):
        h = self._per_expert(x, gen_mask, self.input_layernorm, self.input_layernorm_moe_gen)
        x = x + self.self_attn(h, gen_mask, cos, sin)
        h = self._per_expert(x, gen_mask, self.post_attention_layernorm, self.post_attention_layernorm_moe_gen)
        return x + self._per_expert(h, gen_mask, self.mlp, self.mlp_moe_gen)


class Qwen2MoTModel(nn.Module):
    """BAGEL's language model: ``layers`` of MoT decoder layers, plus generation-specific modules outside them."""

    def __init__(self, vocab_size: int = 64, dim: int = 16, num_layers: int = 2, num_heads: int = 2,
                 mlp_dim: int = 32, latent_dim: int = 4, max_latent_tokens: int = 16):
        super().__init__()
        self.num_heads = num_heads
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        # "Customised" modules: the generation path's input/output projections and timestep embedding.
        self.vae2llm = nn.Linear(latent_dim, dim)
        self.time_embedder = TimestepEmbedder(dim)
        self.latent_pos_embed = nn.Parameter(torch.randn(max_latent_tokens, dim) * 0.02)
        self.layers = nn.ModuleList([Qwen2MoTDecoderLayer(dim, num_heads, mlp_dim) for _ in range(num_layers)])
        self.norm = RMSNorm(dim)
        self.norm_moe_gen = RMSNorm(dim)
        self.rotary_emb = RotaryEmbedding(dim // num_heads)
        self.llm2vae = nn.Linear(dim, latent_dim)

    def forward(self, input_ids: torch.Tensor, latents: torch.Tensor, timestep: torch.Tensor,
                gen_mask: torch.Tensor) -> torch.Tensor:
        """``gen_mask`` (batch, seq) marks the generation tokens; they are the last ``latents.shape[1]``.

        Returns the velocity predicted for the latent tokens.
        """
        num_gen = latents.shape[1]
        gen = self.vae2llm(latents) + self.time_embedder(timestep)[:, None] + self.latent_pos_embed[:num_gen]
        x = torch.cat([self.embed_tokens(input_ids), gen], dim=1)
        if x.shape[:2] != gen_mask.shape:
            raise ValueError(f"gen_mask has shape {tuple(gen_mask.shape)}, the sequence {tuple(x.shape[:2])}")
        cos, sin = self.rotary_emb(torch.arange(x.shape[1]))
        for layer in self.layers:
            x = layer(x, gen_mask, cos, sin)
        return self.llm2vae(self.norm_moe_gen(x[gen_mask].view(x.shape[0], num_gen, -1)))


def _build_qwen2_mot(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    with seeded(seed):
        model = Qwen2MoTModel().eval()
    g = _input_generator(seed)
    num_text, num_gen = 5, 4
    gen_mask = torch.zeros(1, num_text + num_gen, dtype=torch.bool)
    gen_mask[:, num_text:] = True
    inputs = {
        "input_ids": torch.randint(0, 64, (1, num_text), generator=g),
        "latents": torch.randn(1, num_gen, 4, generator=g),
        "timestep": torch.tensor([0.5]),
        "gen_mask": gen_mask,
    }
    return model, inputs


# --------------------------------------------------------------------------------------------------------------
# Cosmos 3, as upstream splits it: a video foundation model (DiT) and a two-pathway language model
# --------------------------------------------------------------------------------------------------------------


class Cosmos3VFMBlock(nn.Module):
    """DiT block: adaLN-modulated self-attention, cross-attention to the language model, MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, context_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_out = nn.Linear(dim, dim)
        self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(context_dim, 2 * dim)
        self.cross_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(approximate="tanh"), nn.Linear(mlp_dim, dim))
        # Six modulation vectors (shift, scale, gate for attention and MLP), stored transposed: (dim, 6) viewed
        # as a non-contiguous parameter, as checkpoints converted from column-major layouts can be.
        self.modulation = nn.Parameter((torch.randn(dim, 6) / dim**0.5).t())

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation[None] + temb[:, None]).unbind(1)
        h = self.norm1(x) * (1 + scale1[:, None]) + shift1[:, None]
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(h).chunk(3, dim=-1))
        x = x + gate1[:, None] * self.attn_out(_merge_heads(F.scaled_dot_product_attention(q, k, v)))
        q = _heads(self.to_q(self.norm_cross(x)), self.num_heads)
        k, v = (_heads(t, self.num_heads) for t in self.to_kv(context).chunk(2, dim=-1))
        x = x + self.cross_out(_merge_heads(F.scaled_dot_product_attention(q, k, v)))
        h = self.norm2(x) * (1 + scale2[:, None]) + shift2[:, None]
        return x + gate2[:, None] * self.ff(h)


class Cosmos3VFMTransformer(nn.Module):
    """Cosmos 3's video foundation model: patch embedding, timestep adaLN, ``layers`` of DiT blocks."""

    def __init__(self, in_channels: int = 4, patch_size: int = 2, dim: int = 16, num_layers: int = 2,
                 num_heads: int = 2, mlp_dim: int = 32, context_dim: int = 16):
        super().__init__()
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.patch_embed = nn.Linear(in_channels * patch_size * patch_size, dim)
        self.time_embedder = TimestepEmbedder(dim)
        self.time_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim))
        self.layers = nn.ModuleList(
            [Cosmos3VFMBlock(dim, num_heads, mlp_dim, context_dim) for _ in range(num_layers)]
        )
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.scale_shift_out = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.proj_out = nn.Linear(dim, in_channels * patch_size * patch_size)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states``: (batch, channels, frames, height, width) latents; returns the same shape."""
        b, c, t, h, w = hidden_states.shape
        p = self.patch_size
        tokens = hidden_states.reshape(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        x = self.patch_embed(tokens.reshape(b, t * (h // p) * (w // p), c * p * p))
        temb = self.time_modulation(self.time_embedder(timestep))
        for layer in self.layers:
            x = layer(x, temb, encoder_hidden_states)
        shift, scale = (self.scale_shift_out[None] + temb[:, None]).unbind(1)
        x = self.proj_out(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])
        x = x.reshape(b, t, h // p, w // p, c, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(b, c, t, h, w)


def _build_cosmos3_vfm(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    with seeded(seed):
        model = Cosmos3VFMTransformer().eval()
    g = _input_generator(seed)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=g),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
    }
    return model, inputs


class _Cosmos3Layer(nn.Module):
    """The parts both pathways' layers have: pre-norm rotary self-attention projections and a SwiGLU MLP.

    The two pathways differ only in what their queries attend to (see their ``forward``).
    """

    def __init__(self, dim: int, num_heads: int, mlp_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_dim)


class Cosmos3UnderstandingLayer(_Cosmos3Layer):
    """Understanding pathway: causal self-attention over the text; hands its keys and values on."""

    def forward(self, x, cos, sin):
        q, k, v = _rotary_qkv(self, self.input_layernorm(x), cos, sin)
        x = x + self.o_proj(_merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x + self.mlp(self.post_attention_layernorm(x)), (k, v)


class Cosmos3GenerationLayer(_Cosmos3Layer):
    """Generation pathway: vision tokens attend to themselves and to the text keys/values of the same depth."""

    def forward(self, x, text_kv, cos, sin):
        q, k, v = _rotary_qkv(self, self.input_layernorm(x), cos, sin)
        k = torch.cat([text_kv[0], k], dim=2)
        v = torch.cat([text_kv[1], v], dim=2)
        x = x + self.o_proj(_merge_heads(F.scaled_dot_product_attention(q, k, v)))
        return x + self.mlp(self.post_attention_layernorm(x))


class Cosmos3LanguageModel(nn.Module):
    """Cosmos 3's language model with its mixture-of-transformers split into two block lists.

    ``layers`` run first over the text (as a prefill whose keys and values a sampler could cache across steps);
    ``gen_layers`` then run over the noisy vision tokens, layer ``i`` attending to the text keys and values
    that ``layers[i]`` produced. Call order: ``layers[0..n-1]``, then ``gen_layers[0..n-1]``.
    """

    def __init__(self, vocab_size: int = 64, dim: int = 16, num_layers: int = 2, num_heads: int = 2,
                 mlp_dim: int = 32, latent_dim: int = 4):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.proj_in = nn.Linear(latent_dim, dim)
        self.time_embedder = TimestepEmbedder(dim)
        self.layers = nn.ModuleList([Cosmos3UnderstandingLayer(dim, num_heads, mlp_dim) for _ in range(num_layers)])
        self.gen_layers = nn.ModuleList([Cosmos3GenerationLayer(dim, num_heads, mlp_dim) for _ in range(num_layers)])
        self.norm = RMSNorm(dim)
        self.norm_moe_gen = RMSNorm(dim)
        self.rotary_emb = RotaryEmbedding(dim // num_heads)
        self.proj_out = nn.Linear(dim, latent_dim)

    def forward(self, input_ids: torch.Tensor, vision_tokens: torch.Tensor, timestep: torch.Tensor):
        """Returns (text hidden states, velocity for the vision tokens)."""
        num_text = input_ids.shape[1]
        cos, sin = self.rotary_emb(torch.arange(num_text + vision_tokens.shape[1]))
        text = self.embed_tokens(input_ids)
        text_kv = []
        for layer in self.layers:
            text, kv = layer(text, cos[:num_text], sin[:num_text])
            text_kv.append(kv)
        gen = self.proj_in(vision_tokens) + self.time_embedder(timestep)[:, None]
        for layer, kv in zip(self.gen_layers, text_kv):
            gen = layer(gen, kv, cos[num_text:], sin[num_text:])
        return self.norm(text), self.proj_out(self.norm_moe_gen(gen))


def _build_cosmos3_lm(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    with seeded(seed):
        model = Cosmos3LanguageModel().eval()
    g = _input_generator(seed)
    inputs = {
        "input_ids": torch.randint(0, 64, (1, 6), generator=g),
        "vision_tokens": torch.randn(1, 8, 4, generator=g),
        "timestep": torch.tensor([0.5]),
    }
    return model, inputs


# --------------------------------------------------------------------------------------------------------------
# SDXL's UNet under its own class name
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sdxl_unet_cls() -> type:
    """``SDXLUNet2DConditionModel``: diffusers' UNet2DConditionModel, subclassed only to carry the name.

    Created on first use so that importing the zoo does not import diffusers.
    """
    from diffusers import UNet2DConditionModel

    return type(
        "SDXLUNet2DConditionModel",
        (UNet2DConditionModel,),
        {"__module__": __name__, "__doc__": "UNet2DConditionModel with an SDXL config, under SDXL's class name."},
    )


def __getattr__(name: str):  # PEP 562: `from standins import SDXLUNet2DConditionModel`
    if name == "SDXLUNet2DConditionModel":
        return _sdxl_unet_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_sdxl_unet(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    _, config = CONFIGS["sdxl-unet"]
    with seeded(seed):
        model = _sdxl_unet_cls()(**config).eval()
    with torch.no_grad():
        inputs = _inputs_sdxl_unet(model, _input_generator(seed))
    return model, inputs


# --------------------------------------------------------------------------------------------------------------
# Registry (keyed by class name: that is how the offloader recognises them)
# --------------------------------------------------------------------------------------------------------------

STANDINS: dict[str, TinySpec] = {
    "NextStepModel": TinySpec(
        "NextStepModel", ("layers",),
        "NextStep-1.1 decoder-only LM; LM head tied to the embedding; non-persistent rotary buffer per layer",
        _build_nextstep,
    ),
    "Qwen2MoTModel": TinySpec(
        "Qwen2MoTModel", ("layers",),
        "BAGEL mixture-of-transformers LM; bfloat16 generation expert per layer; customised modules outside",
        _build_qwen2_mot,
    ),
    "Cosmos3VFMTransformer": TinySpec(
        "Cosmos3VFMTransformer", ("layers",),
        "Cosmos 3 video DiT with timestep adaLN; non-contiguous modulation parameter per block",
        _build_cosmos3_vfm,
    ),
    "Cosmos3LanguageModel": TinySpec(
        "Cosmos3LanguageModel", ("layers", "gen_layers"),
        "Cosmos 3 language model: understanding `layers`, then generation `gen_layers`",
        _build_cosmos3_lm,
    ),
    "SDXLUNet2DConditionModel": TinySpec(
        "SDXLUNet2DConditionModel", ("down_blocks", "up_blocks"),
        "diffusers UNet2DConditionModel with an SDXL config, under its SDXL class name",
        _build_sdxl_unet,
    ),
}


def build_standin(name: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """Build the stand-in ``name`` (a key of :data:`STANDINS`, its class name) and inputs for ``model(**inputs)``."""
    try:
        spec = STANDINS[name]
    except KeyError:
        raise KeyError(f"unknown stand-in {name!r}; known: {', '.join(STANDINS)}") from None
    model, inputs = spec.build(seed)
    model.requires_grad_(False)
    return model, inputs
