"""FiCoCo inside Hugging Face's LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP tower and a
LLaMA decoder. This file alone knows those classes; the method lives in ficoco.methods.

Nothing of transformers' model source is copied: reducing layers are re-composed from the
layer's own submodules (norms, attention, MLP) so the reduction can sit between the
attention residual and the MLP, and every other layer runs its own forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ficoco.errors import FicocoError
from ficoco.methods.inputs import ImageGrids, TokenGrid
from ficoco.models import hf_compat as hf
from ficoco.models.base import FamilyAdapter
from ficoco.models.inputs import PREFIX_TOKENS, synthetic_inputs  # noqa: F401  (the family's, for the registry)
from ficoco.models.patching import Patches, span_lengths
from ficoco.models.prompt import PromptFormat

if TYPE_CHECKING:
    from ficoco.models.handle import Handle


class LlavaAdapter(FamilyAdapter):
    """Where the method goes in a LLaVA-1.5 model (its CLIP tower), and the image-span bookkeeping
    (every image span shortened to its first `keep` placeholders); the entry's hooks and the decoder's
    parts are the base's (`FamilyAdapter`)."""

    # Families built the same way (a CLIP tower, a LLaMA decoder, one placeholder token per
    # visual token) subclass this and set these: the inner model's tower that FiCoCo-V
    # reduces in, the config keys of the placeholder id of the span both variants act on
    # (and the base's `pixel_inputs`: the forward/generate inputs that carry pixels).
    tower_attribute = "vision_tower"
    placeholder_config_keys: tuple[str, ...] = ("image_token_id", "image_token_index")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.vision_layers = hf.clip_layers(hf.clip_tower(model, self.tower_attribute))
        self.decoder_layers = hf.decoder_layers(model)
        config = model.config
        # The placeholder id of the span FiCoCo acts on (LLaVA: the image placeholder).
        self.image_token_id = next((value for key in self.placeholder_config_keys
                                    if (value := getattr(config, key, None)) is not None), None)
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        self.grid_hw = (side, side)
        # The tower's patch grid of one item, before any merge of patches into tokens (none here).
        self.patch_grid_hw = (side, side)
        self.patches = side * side
        # Placeholders of one unshortened span unit (LLaVA: one image, one per patch).
        self.span_tokens = self.patches

    def stage_modules(self) -> dict[str, nn.Module]:
        """The modules of the accountant's stages, for counters that attribute by module."""
        model = self.model
        return {"vision": hf.clip_tower(model, self.tower_attribute), "projector": hf.projector(model),
                "llm": hf.language_model(model), "lm_head": hf.lm_head(model)}

    def kept_token_index(self, input_ids: Tensor, keep: int) -> Tensor | None:
        """(B, T') the positions of `input_ids` that FiCoCo-V's shortened prompt keeps: every token
        but the placeholders past the first `keep` of every full span unit (`span_tokens`: an
        image's 576 for LLaVA-1.5). None when the input holds no placeholder. Every span must be
        whole (the caller's own prompt); one host synchronisation (the placeholder counts)."""
        if keep > self.span_tokens:
            raise FicocoError(f"the method handed the LLM {keep} visual tokens per image, more than the "
                              f"{self.span_tokens} placeholders of an image span (the prompt is shortened, never "
                              "lengthened); give a setting that keeps fewer")
        is_image = input_ids == self.image_token_id
        counts = is_image.sum(dim=1).tolist()
        if not any(counts):
            return None
        if len(set(counts)) != 1:
            raise FicocoError("every sample of a batch must hold the same number of images for FiCoCo-V")
        total = counts[0]
        if total % self.span_tokens:
            raise FicocoError(f"image spans of {total} placeholders are not multiples of {self.span_tokens} "
                              "(give the prompt as the processor lays it out, every image span whole)")
        # Rank of each placeholder inside its span unit: position in the run of placeholders.
        rank = (torch.cumsum(is_image.long(), dim=1) - 1) % self.span_tokens
        drop = is_image & (rank >= keep)
        # Every sample drops the same (host-known) number of placeholders, so a stable sort of
        # the drop flags lists the kept positions in order without a data-dependent nonzero().
        length = input_ids.shape[1] - (total // self.span_tokens) * (self.span_tokens - keep)
        return torch.sort(drop.to(torch.int8), dim=1, stable=True).indices[:, :length]

    def image_grids(self, title: str, input_ids: Tensor) -> tuple[tuple[ImageGrids, ...], ...]:
        """Every span of placeholders one image (Video-LLaVA: one video; InternVL: one image's tiles), made of
        units of `span_tokens` (an image, a frame, a tile) that each lay their last `grid_hw` tokens out as one
        grid (a Video-LLaVA frame's [CLS] first, on no grid). One host synchronisation (the span lengths)."""
        rows, cols = self.grid_hw
        lead = self.span_tokens - rows * cols
        found = []
        for lengths in span_lengths(self.language_tokens(input_ids)):
            images, start = [], 0
            for length in lengths:
                if length % self.span_tokens:
                    raise FicocoError(f"{title}: an image span of {length} placeholders is not whole units of "
                                      f"{self.span_tokens} (give the prompt as the processor lays it out)")
                grids = tuple(TokenGrid(start + unit + lead, rows, cols, cols)
                              for unit in range(0, length, self.span_tokens))
                images.append(ImageGrids(start, length, grids, self.patch_grid_hw))
                start += length
            found.append(tuple(images))
        return tuple(found)

    def kept_span_flags(self, handle: Handle) -> Tensor | None:
        """Every span unit of this call (an image; a Video-LLaVA frame, its [CLS] first; an InternVL tile), True
        where the cut's tokens came from (`handle.vision_state`, the unit each token continues), sample after
        sample. None before a cut ran, or where a token stands for no single unit (merged)."""
        origin = handle.vision_state
        if origin is None or bool((origin < 0).any()):
            return None
        lead = int(self.projector_keeps_cls)  # Video-LLaVA's frame [CLS], handed on before its patches
        flags = torch.zeros(origin.shape[0], self.span_tokens, dtype=torch.bool, device=origin.device)
        flags[:, :lead] = True
        return flags.scatter(1, origin + lead, torch.ones_like(origin, dtype=torch.bool)).flatten()

    def patch_tower(self, handle: Handle, patches: Patches, spec: Any, schedule: Any) -> None:
        """The tower's and the projector's hook points for a vision-side method (ficoco.models.vision_steps)."""
        from ficoco.models.vision_steps import TowerPatch

        config = self.model.config
        if getattr(config, "vision_feature_select_strategy", "default") != "default" or \
                not isinstance(getattr(config, "vision_feature_layer", -2), int):
            raise FicocoError(f"{spec.title} needs vision_feature_select_strategy='default' and one "
                              "vision_feature_layer ([CLS] dropped before the projector)")
        TowerPatch(self, handle, spec, schedule).install(patches)



# The whole processor lays a LLaVA-1.5 prompt out (transformers builds it without torchvision).
PROMPT = PromptFormat()
