"""The phases of a pipeline call: which components run when, and how often.

A pipeline never runs all its components at once: it encodes the prompt, denoises (Wan2.2 with its
high-noise expert, then its low-noise expert), and decodes. A :class:`Phase` names the components
that run in one stretch of a call, how many forwards each makes there, and, for a denoising phase,
its share of the steps. The planner gives the device to the phase that runs
(:mod:`.planner`), and the strategies switch at the phase boundaries (``strategies/phases.py``).

Phases come from the pipeline's structure where it is known (:data:`KNOWN`: the classes whose
experts run in turn, or whose guidance is two DiT calls per step), else from a generic rule over the
component kinds (encoders, then every DiT together, then the decoders: DiTs of an unknown pipeline
are assumed to run together, the safe side, since parking one that runs again in the same step
would reload it every forward; other components, such as a controlnet, with the encoders and with
the DiTs; its VAE both at the start, encoding an image, and at the end). A call's real order, seen by the strategies, replaces them
(:func:`observed`). Plain data and arithmetic: no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

#: where a phase list comes from
STRUCTURE, GENERIC, OBSERVED = "pipeline structure", "generic rule", "observed in a call"
#: denoising steps a plan assumes when the call does not say (diffusers' default for most pipelines)
DEFAULT_STEPS = 50


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stretch of a call. ``components``: what runs in it, in order. ``forwards_per_step``:
    forwards of each DiT per denoising step (two where guidance is two calls), 0 outside the
    denoising loop; ``forwards_per_call``: forwards of each component per call outside it (a text
    encoder run for the prompt and the negative prompt: two). ``share``: the share of the steps a
    denoising phase runs (an expert's). ``batch``: the batch of each DiT forward (guidance batched
    into one call: two)."""

    name: str
    components: tuple[str, ...]
    forwards_per_step: int = 0
    forwards_per_call: int = 1
    share: float = 1.0
    batch: int = 1

    @property
    def denoising(self) -> bool:
        return self.forwards_per_step > 0

    def forwards(self, steps: int) -> float:
        """Forwards of each of its components in one call of ``steps`` denoising steps."""
        return self.forwards_per_step * steps * self.share if self.denoising else float(self.forwards_per_call)


@dataclasses.dataclass(frozen=True)
class Known:
    """A pipeline class's structure: its DiTs run in turn (``experts``, each its share of the
    steps, in order), its guidance is ``guidance_calls`` DiT calls per step (1: none, or batched
    into one call of batch 2, ``guidance_batch``), its encoders run ``encoder_calls`` times per call
    (prompt and negative prompt encoded apart), and its VAE also encodes (image-conditioned)."""

    experts: tuple[tuple[str, float], ...] = ()
    guidance_calls: int = 1
    guidance_batch: int = 1
    encoder_calls: int = 1
    vae_encodes: bool = False
    steps: int = DEFAULT_STEPS
    height: int = 1024
    width: int = 1024
    frames: int = 1


#: pipeline class name -> its structure, where the generic rule is wrong or too vague. Wan2.2's experts
#: split the steps at ``boundary_ratio`` of the timesteps; with its default flow shift about half the
#: steps are above the boundary (stated as the share; a call's own split is observed)
KNOWN: dict[str, Known] = {
    "WanPipeline": Known(experts=(("transformer", 0.5), ("transformer_2", 0.5)), guidance_calls=2, encoder_calls=2,
                         steps=40, height=480, width=832, frames=81),
    "WanImageToVideoPipeline": Known(experts=(("transformer", 0.5), ("transformer_2", 0.5)), guidance_calls=2,
                                     encoder_calls=2, vae_encodes=True, steps=40, height=480, width=832, frames=81),
    "QwenImagePipeline": Known(guidance_calls=2, encoder_calls=2),
    "Flux2Pipeline": Known(steps=50),
    "StableDiffusion3Pipeline": Known(guidance_batch=2, steps=28),
    "StableDiffusionXLPipeline": Known(guidance_batch=2),
}
#: the names the real-size pipelines of ``offload-core plan`` stand for
REAL_CLASSES = {"real:flux2-dev": "Flux2Pipeline", "real:wan2.2-t2v-a14b": "WanPipeline",
                "real:qwen-image": "QwenImagePipeline"}


def pipeline_phases(cls_name: str | None, components: Sequence[tuple[str, str]],
                    guidance: bool | None = None) -> tuple[tuple[Phase, ...], str, int]:
    """The phases of a pipeline of class ``cls_name`` (None: a bare model, one phase) whose
    weight-holding ``components`` are ``(name, kind)`` in their usual order of use; ``guidance``:
    whether the call runs classifier-free guidance (None: the pipeline's usual call does). Returns
    the phases, where they come from, and the steps a call is assumed to make."""
    names = [name for name, _ in components]
    if cls_name is None:
        return (Phase("forward", tuple(names), forwards_per_step=1),), STRUCTURE, 1
    known = KNOWN.get(cls_name)
    source = STRUCTURE if known is not None else GENERIC
    known = known or Known()
    guided = guidance is not False
    calls = known.guidance_calls if guided else 1
    batch = known.guidance_batch if guided else 1
    kinds = dict(components)
    encoders = tuple(n for n in names if kinds[n] == "text_encoder")
    others = tuple(n for n in names if kinds[n] == "other")  # controlnets, adapters, image encoders: anywhere
    dits = [n for n in names if kinds[n] == "dit"]
    vaes = tuple(n for n in names if kinds[n] == "vae")
    phases: list[Phase] = []
    # a pipeline not known may encode an image with its VAE before denoising (img2img, inpainting,
    # control images): taken to, the safe side
    first = encoders + others + (vaes if known.vae_encodes or source == GENERIC else ())
    if first:
        phases.append(Phase("encode", first, forwards_per_call=known.encoder_calls if guided else 1))
    experts = [(n, share) for n, share in known.experts if n in dits]
    if experts and len(experts) == len(dits):
        total = sum(share for _, share in experts)
        for name, share in experts:
            phases.append(Phase(f"denoise {name}", (name, *others), forwards_per_step=calls, share=share / total,
                                batch=batch))
    elif dits:
        phases.append(Phase("denoise", (*dits, *others), forwards_per_step=calls, batch=batch))
    if vaes:
        phases.append(Phase("decode", vaes))
    return tuple(phases), source, known.steps


#: call arguments that scale classifier-free guidance: above 1 it runs
GUIDANCE_ARGUMENTS = ("guidance_scale", "true_cfg_scale")


def guided(call: dict) -> bool | None:
    """Whether a call with arguments ``call`` runs classifier-free guidance: None when it does not
    say (the pipeline's usual call does)."""
    scales = [call[name] for name in GUIDANCE_ARGUMENTS if isinstance(call.get(name), (int, float))]
    return any(scale > 1 for scale in scales) if scales else None


def default_shape(cls_name: str | None) -> tuple[int, int, int]:
    """(height, width, frames) of a call of pipeline class ``cls_name`` when the call does not say
    (the generic rule: a 1024 x 1024 image)."""
    known = KNOWN.get(cls_name or "", Known())
    return known.height, known.width, known.frames


def guidance_batch(cls_name: str | None, guidance: bool | None = None) -> int:
    """The batch of each DiT forward of pipeline class ``cls_name``: two where guidance is batched."""
    return KNOWN.get(cls_name or "", Known()).guidance_batch if guidance is not False else 1


def observed(order: Sequence[str], kinds: Mapping[str, str], steps: int) -> tuple[Phase, ...]:
    """The phases of one call in which the components named in ``order`` began their outermost
    forwards in that order, over ``steps`` denoising steps. The DiT forwards form the denoising part:
    DiTs that each ran in one stretch ran in turn (a phase each, its share of the steps the share of
    its forwards); DiTs that alternated ran together (one phase). The other components split into
    the stretches before and after it."""
    runs: list[list[str]] = []  # consecutive stretches of DiT forwards and of other forwards
    for name in order:
        if runs and (kinds.get(runs[-1][0]) == "dit") == (kinds.get(name) == "dit"):
            runs[-1].append(name)
        else:
            runs.append([name])
    steps = max(steps, 1)
    phases: list[Phase] = []
    seen_dit = False
    for run in runs:
        members = tuple(dict.fromkeys(run))
        if kinds.get(run[0]) != "dit":
            phases.append(Phase("decode" if seen_dit else "encode", members,
                                forwards_per_call=max(run.count(m) for m in members)))
            continue
        seen_dit = True
        stretches = [s for s in _stretches(run)]
        if len(stretches) == len(members):  # each DiT in one stretch: in turn
            per_step = max(1, round(len(run) / steps))
            for member, length in stretches:
                phases.append(Phase(f"denoise {member}", (member,), forwards_per_step=per_step,
                                    share=length / len(run)))
        else:
            phases.append(Phase("denoise", members, forwards_per_step=max(1, round(len(run) / len(members) / steps))))
    names = [p.name for p in phases]
    return tuple(dataclasses.replace(p, name=f"{p.name} {i}") if names.count(p.name) > 1 else p
                 for i, p in enumerate(phases, 1))


def _stretches(run: Sequence[str]) -> list[tuple[str, int]]:
    """``(name, length)`` of each stretch of one name in ``run``."""
    out: list[tuple[str, int]] = []
    for name in run:
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
    return out
