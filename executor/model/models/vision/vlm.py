"""What every vision-language model shares: its language model does the per-token work (the engine merges
the encoder's rows into `inputs_embeds` first), and its checkpoint streams in two parts, the language
model's tensors on to the language model's own stream_weights, the vision side's copied by the model."""
from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.executor.model.layers.attention import PagedAttention
from pagedserve.executor.model.layers.linear import copy_weight
from pagedserve.executor.model.models.weight_loading import LoadableModel
from pagedserve.kernels.attention.metadata import AttentionMetadata

NamedTensors = Iterable[tuple[str, torch.Tensor]]
SKIP = "<skip>"           # vision_param: a tensor this rank reads past (a later stage's, an unused layer's)


# A (language model, vision tower, projector) checkpoint's names, canonical as transformers 5's save_pretrained
# writes them: its in-memory names are renamed (first match wins), and the hub's classic layout, which nests the
# tower's modules one level deeper (CLIPVisionModel / SiglipVisionModel.vision_model), is flattened. Llava and
# Gemma 3 share it.
_TOWER_PREFIXES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                   ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))
_CLASSIC_TOWER = "vision_tower.vision_model."


def tower_canonical_name(name: str) -> str:
    for old, new in _TOWER_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if name.startswith(_CLASSIC_TOWER):
        name = "vision_tower." + name[len(_CLASSIC_TOWER):]
    return name


def tied_text_config(hf_config: Any) -> Any:
    """The text model's config, tied as the top-level config says: HF ties a VLM's lm_head by that flag
    (Idefics3, Qwen2-VL), whatever text_config's own says."""
    text = hf_config.text_config
    tied = getattr(hf_config, "tie_word_embeddings", None)
    if tied is None or bool(tied) == bool(getattr(text, "tie_word_embeddings", False)):
        return text
    text = copy.copy(text)
    text.tie_word_embeddings = bool(tied)
    return text


class VisionLanguageModel(LoadableModel):
    language_model: Any        # the registered causal LM of text_config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> Any:
        """The language model's forward: hidden states [T, hidden] (or (hidden, residual) before the last
        stage); inputs_embeds [T, hidden], image features merged in, replace the embeddings of input_ids."""
        return self.language_model(input_ids, positions, meta, intermediate, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return self.language_model.attention_layers()

    def make_decode_step(self) -> Any:
        return self.language_model.make_decode_step()

    def stream_weights(self, weights: NamedTensors) -> set[str]:
        """Tensors in any of the model's checkpoint layouts; the canonical names consumed, comparable with
        expected_weights()."""
        loaded: set[str] = set()
        current: list[str | None] = [None]
        try:
            text_loaded = self.language_model.stream_weights(self.route_weights(weights, loaded, current))
        except ValueError as exc:       # the language model names the tensor by its own name
            name = current[0]
            if name is None or name in str(exc):
                raise
            raise ValueError(f"{exc} (checkpoint tensor {name!r})") from exc
        return loaded | {self.text_checkpoint_name(name) for name in text_loaded}

    def route_weights(self, weights: NamedTensors, loaded: set[str],
                      current: list[str | None]) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors under its own names; the vision side's copied here, their canonical
        names added to `loaded`; current[0]: the checkpoint name being read (for errors)."""
        params = dict(self.named_parameters())
        for raw, tensor in weights:
            current[0] = raw
            name = self.canonical_name(raw)
            text = self.text_name(name)
            if text is not None:
                yield text, tensor
                continue
            own = self.vision_param(name)
            if own == SKIP:
                continue
            if own is None or own not in params:
                raise ValueError(f"checkpoint tensor {raw!r} has no matching parameter in {type(self).__name__}")
            copy_weight(params[own].data, tensor, f"checkpoint tensor {raw!r}")
            loaded.add(name)
        current[0] = None

    def canonical_name(self, raw: str) -> str:
        """A checkpoint tensor's name in the model's canonical layout."""
        raise NotImplementedError

    # Where the canonical layout keeps the language model's tensors (`TEXT_PREFIX` + its own `model.*` names,
    # the head as `lm_head.*`): Idefics3's and Qwen2-VL's layouts; a family that names them otherwise overrides
    # text_name and text_checkpoint_name.
    TEXT_PREFIX = ""
    HEAD_PREFIX = "lm_head."

    def text_name(self, name: str) -> str | None:
        """A canonical name as the language model names it; None for a vision-side tensor."""
        if not self.TEXT_PREFIX:
            raise NotImplementedError
        if name.startswith(self.TEXT_PREFIX):
            return "model." + name[len(self.TEXT_PREFIX):]
        return name if name.startswith(self.HEAD_PREFIX) else None

    def vision_param(self, name: str) -> str | None:
        """The parameter a vision-side tensor loads into, SKIP for one this rank has no use for, None for
        no parameter at all (refused)."""
        raise NotImplementedError

    def text_checkpoint_name(self, name: str) -> str:
        """A language-model parameter's name (`model.*`, `lm_head.*`) as the canonical checkpoint names it."""
        if not self.TEXT_PREFIX:
            raise NotImplementedError
        return self.TEXT_PREFIX + name[len("model."):] if name.startswith("model.") else name
