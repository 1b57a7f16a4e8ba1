"""What the official-rule tests of the methods that act before the LLM share (tests/test_rule_<method>.py for
VisionZip, FasterVLM, PruMerge+, DivPrune, VisPruner, CDPruner and ToMe on llava-tiny): the quantities the
official codes read, taken from the **unpatched** tower (eager attention, as their `output_attentions=True`
runs it), and what a patched model hands its projector and the LLM.

Nothing here knows a method: each test file re-states its method's rule in its own code on these quantities.
Test files import them as `from rule_support_vision import ...` (tests/ is on sys.path, as for helpers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ficoco


@dataclass(frozen=True)
class TowerPass:
    """One forward of the unpatched CLIP tower under eager attention.

    ``hidden_states``: HF's ``output_hidden_states`` (index 0 the encoder's input, index ``i + 1`` layer
    ``i``'s output), ``attentions``: every layer's ``(B, H, T, T)`` softmax, ``queries`` / ``keys``: every
    layer's ``q_proj`` / ``k_proj`` output ``(B, T, C)`` (heads not split, as forward hooks on the
    projections see them)."""

    hidden_states: tuple[Tensor, ...]
    attentions: tuple[Tensor, ...]
    queries: tuple[Tensor, ...]
    keys: tuple[Tensor, ...]
    heads: int

    def head_mean_keys(self, layer: int) -> Tensor:
        """``(B, T, C / H)`` layer `layer`'s keys averaged over its heads (``k.mean(1)`` of the split keys)."""
        batch, tokens, width = self.keys[layer].shape
        return self.keys[layer].reshape(batch, tokens, self.heads, width // self.heads).mean(dim=2)


def tower_layers(model: nn.Module) -> nn.ModuleList:
    """The LLaVA model's CLIP encoder layers."""
    return model.model.vision_tower.encoder.layers


def feature_layer(model: nn.Module) -> int:
    """The tower layer whose output the projector reads (``vision_feature_layer``, -2 on LLaVA-1.5: layer 22 of
    24; layer 4 of llava-tiny's 6)."""
    return len(tower_layers(model)) + model.config.vision_feature_layer


def unpatched_tower(model: nn.Module, pixel_values: Tensor) -> TowerPass:
    """The unpatched tower's forward with eager attention and ``output_attentions=True`` (the official codes'
    call), its attention implementation restored afterwards."""
    if "_ficoco_handle" in model.__dict__:
        raise RuntimeError("the official quantities come from the unpatched model: remove the handle first")
    tower = model.model.vision_tower
    seen: dict[str, list[Tensor]] = {"q": [], "k": []}
    hooks = []
    for layer in tower_layers(model):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(lambda m, a, out: seen["q"].append(out)))
        hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda m, a, out: seen["k"].append(out)))
    config = tower.config
    implementation = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = tower(pixel_values, output_hidden_states=True, output_attentions=True)
    finally:
        config._attn_implementation = implementation
        for hook in hooks:
            hook.remove()
    return TowerPass(hidden_states=out.hidden_states, attentions=out.attentions, queries=tuple(seen["q"]),
                     keys=tuple(seen["k"]), heads=tower_layers(model)[0].self_attn.num_heads)


def unpatched_projector(model: nn.Module, features: Tensor) -> Tensor:
    """The unpatched projector's output for `features` ``(B, N, C)``."""
    with torch.no_grad():
        return model.model.multi_modal_projector(features)


@dataclass(frozen=True)
class PatchedRun:
    """What ficoco did in one forward: its records, the projector's input (after a cut at the tower's output)
    and the visual tokens the LLM received (the projector's output, after a cut there), and the settings it
    ran."""

    records: list[Any]
    projector_input: Tensor
    llm_visual: Tensor
    settings: dict[str, Any]


def patched_run(model: nn.Module, inputs: dict[str, Tensor], method: str, **setting: Any) -> PatchedRun:
    """One forward of `model` under ``ficoco.apply(model, method, **setting)``; the handle is removed after."""
    projector = model.model.multi_modal_projector
    seen: dict[str, Tensor] = {}
    with torch.no_grad(), ficoco.apply(model, method, **setting) as handle:
        hooks = [projector.linear_1.register_forward_pre_hook(lambda m, args: seen.__setitem__("in", args[0])),
                 projector.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out))]
        try:
            model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        records = list(handle.records)
        settings = handle.schedule.settings_dict()
    return PatchedRun(records=records, projector_input=seen["in"], llm_visual=seen["out"], settings=settings)


def assert_decided(scores: Tensor, k: int, gap: float = 1e-7) -> None:
    """The top `k` of every row of `scores` ``(B, N)`` are apart from the rest by more than `gap` (so rounding
    between the official quantities and ficoco's own cannot swap them): a test's inputs must decide its rule.
    Raises RuntimeError, not AssertionError, so that a test expecting a break to be caught cannot pass on it."""
    if not 0 < k < scores.shape[1]:
        return
    ranked = scores.sort(dim=1, descending=True).values
    margin = ranked[:, k - 1] - ranked[:, k]
    if not bool((margin > gap).all()):
        raise RuntimeError(f"these inputs do not decide the top {k}: margins {margin.tolist()}; pick another seed")


# ---- Qwen2-VL (qwen2-vl-tiny): no [CLS], a packed tower, merge groups of 2 x 2 patches as the units ----------

@dataclass(frozen=True)
class QwenTowerPass:
    """One forward of the unpatched Qwen2-VL tower: per image the last block's keys ``(H, T, d)`` as its
    attention uses them (rotary applied), in the tower's order (a merge group's 4 patches consecutive, the groups
    row-major); the PatchMerger's input ``(patches, C)`` and output ``(groups, D)`` of every image in turn; every
    image's ``(rows, cols)`` of patches."""

    keys: list[Tensor]
    merger_input: Tensor
    merger_output: Tensor
    grids: list[tuple[int, int]]

    def image_groups(self, image: int, tensor: Tensor, per_group: int = 1) -> Tensor:
        """The rows of `tensor` (every image's groups, `per_group` rows each, in turn) that belong to `image`."""
        sizes = [rows * cols // 4 * per_group for rows, cols in self.grids]
        return tensor.split(sizes)[image]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unpatched_qwen_tower(model: nn.Module, inputs: dict[str, Tensor]) -> QwenTowerPass:
    """The unpatched Qwen2-VL tower on `inputs`: the last block's keys recomputed from its own ``qkv`` and the
    rotary table it was given, and the merger's input and output."""
    if "_ficoco_handle" in model.__dict__:
        raise RuntimeError("the official quantities come from the unpatched model: remove the handle first")
    visual = model.model.visual
    seen: dict[str, Any] = {}

    def block_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        seen["cu_seqlens"], seen["rotary"] = kwargs["cu_seqlens"], kwargs["position_embeddings"]

    hooks = [visual.blocks[-1].attn.register_forward_pre_hook(block_input, with_kwargs=True),
             visual.merger.register_forward_hook(lambda m, args, out: seen.update(merger_in=args[0], merger_out=out))]
    try:
        with torch.no_grad():
            model.model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    finally:
        for hook in hooks:
            hook.remove()
    attn = visual.blocks[-1].attn
    tokens = seen["hidden"].shape[0]
    with torch.no_grad():
        keys = attn.qkv(seen["hidden"]).reshape(tokens, 3, attn.num_heads, -1)[:, 1]  # (T, H, d)
    cos, sin = (t.unsqueeze(-2).float() for t in seen["rotary"])
    keys = (keys.float() * cos + _rotate_half(keys.float()) * sin).to(keys.dtype)
    lengths = (seen["cu_seqlens"][1:] - seen["cu_seqlens"][:-1]).tolist()
    grids = [(int(h), int(w)) for _, h, w in inputs["image_grid_thw"].tolist()]
    return QwenTowerPass(keys=[k.transpose(0, 1) for k in keys.split(lengths)], merger_input=seen["merger_in"],
                         merger_output=seen["merger_out"], grids=grids)


def qwen_patched_run(model: nn.Module, inputs: dict[str, Tensor], method: str, **setting: Any) -> PatchedRun:
    """`patched_run` for Qwen2-VL: the merger's LayerNorm input (after a cut at the tower's output) and the
    merger's output (after a cut there, every image's kept groups in turn)."""
    merger = model.model.visual.merger
    seen: dict[str, Tensor] = {}
    with torch.no_grad(), ficoco.apply(model, method, **setting) as handle:
        hooks = [merger.ln_q.register_forward_pre_hook(lambda m, args: seen.__setitem__("in", args[0])),
                 merger.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out))]
        try:
            model(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        records = list(handle.records)
        settings = handle.schedule.settings_dict()
    return PatchedRun(records=records, projector_input=seen["in"], llm_visual=seen["out"], settings=settings)


def group_patch_indices(groups: list[int], cols: int) -> list[int]:
    """The row-major patch-grid indices (sorted) of the 2 x 2 merge groups `groups` (row-major on the group
    grid) of an image `cols` patches wide: what ficoco's records hold for the groups a cut keeps."""
    return sorted((2 * (g // (cols // 2)) + dr) * cols + 2 * (g % (cols // 2)) + dc
                  for g in groups for dr in (0, 1) for dc in (0, 1))


def equivalent_token_group_scores(keys: Tensor) -> Tensor:
    """``(groups,)`` ficoco's score of every merge group on a tower without [CLS] (docs/methods/ficoco.md, the
    equivalent token): ``-cos(mean_j M_j, M_i)`` of every patch's head-mean key ``M_i`` (``keys`` ``(H, T, d)``),
    averaged over each group's 4 consecutive patches."""
    mean_keys = keys.mean(dim=0)
    score = -F.cosine_similarity(mean_keys.mean(dim=0, keepdim=True), mean_keys, dim=-1)
    return score.reshape(-1, 4).mean(dim=1)
