"""The vLLM plugin's PixelPrune selection, engine-free (ficoco.serving.vllm.tokens; no vLLM needed): the processor
and the model read each image's kept merge groups from its packed patches, and vLLM 0.32 hands them its
processor's 8-bit values (the tower normalises them, `mm_input_norm`). The selector must read the float pixels
ficoco's transformers adapter reads: transformers' torchvision image processor's fused rescale and normalisation
(transformers 5.19, image_processing_backends.py, TorchvisionBackend._fuse_mean_std_and_rescale_factor and
rescale_and_normalize: mean and std scaled by 1 / rescale_factor as float32 tensors, then (x - mean) / std in
float32), restated here in the test's own arithmetic."""

from __future__ import annotations

import torch

from ficoco.methods.pixelprune import CLIP_NORMALISATION, HALF_NORMALISATION
from ficoco.methods.pixelprune.ops import group_pixels, keep_map
from ficoco.serving.vllm.tokens import PatchLayout, pixel_kept_groups

CHANNELS, TEMPORAL, PATCH, MERGE_SIZE = 3, 2, 4, 2


def _layout(normalisation: tuple[tuple[float, ...], tuple[float, ...]]) -> PatchLayout:
    mean, std = normalisation
    return PatchLayout(channels=CHANNELS, temporal_patch_size=TEMPORAL, patch_size=PATCH, merge_size=MERGE_SIZE,
                       mean=mean, std=std)


def _packed(image: torch.Tensor) -> torch.Tensor:
    """(patches, C x T x P x P) of a (C, H, W) uint8 image, as the Qwen processors pack it: merge groups in grid
    order, a group's 2 x 2 patches consecutive, the frame repeated over the temporal patch."""
    c, h, w = image.shape
    rows, cols = h // (PATCH * MERGE_SIZE), w // (PATCH * MERGE_SIZE)
    x = image.reshape(c, rows, MERGE_SIZE, PATCH, cols, MERGE_SIZE, PATCH)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # group row, group col, patch row, patch col, C, P, P
    x = x.unsqueeze(-3).expand(*x.shape[:5], TEMPORAL, PATCH, PATCH)
    return x.reshape(-1, c * TEMPORAL * PATCH * PATCH)


def _image(seed: int) -> torch.Tensor:
    """A 3 x 48 x 40 uint8 picture (6 x 5 groups of 8 x 8 pixels): noise under a flat band of 2 group rows and a
    flat block, so that some groups repeat their neighbours exactly."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (3, 48, 40), generator=generator, dtype=torch.uint8)
    image[:, :16] = torch.tensor([12, 200, 99], dtype=torch.uint8)[:, None, None]
    image[:, 32:, :24] = 7
    return image


def test_8_bit_pixels_are_normalised_as_transformers_torchvision_processor_normalises_them() -> None:
    pixels = _packed(_image(0))
    for normalisation in (CLIP_NORMALISATION, HALF_NORMALISATION):
        mean, std = normalisation
        scale = 1 / 255
        fused_mean = torch.tensor(mean) * (1.0 / scale)  # float32 tensors, as the processor makes them
        fused_std = torch.tensor(std) * (1.0 / scale)
        channels = pixels.to(torch.float32).view(pixels.shape[0], CHANNELS, -1)
        expected = ((channels - fused_mean[None, :, None]) / fused_std[None, :, None]).view(pixels.shape)
        got = _layout(normalisation).normalised(pixels)
        assert got.dtype == torch.float32 and torch.equal(got, expected)  # bit for bit
        assert _layout(normalisation).normalised(expected) is expected  # floats pass as given


def test_the_kept_groups_are_the_official_rules_on_the_image_and_every_image_keeps_its_own() -> None:
    from ficoco.methods.pixelprune.ops import tower_step

    images = [_image(1), _image(2), _image(3)[:, :32]]  # two of 6 x 5 groups, one of 4 x 5
    grids = [(1, 12, 10), (1, 12, 10), (1, 8, 10)]
    pixels = torch.cat([_packed(image) for image in images])
    layout = _layout(HALF_NORMALISATION)
    settings = {"metric": "max", "threshold": 0.0, "anchored": True}
    kept = pixel_kept_groups(pixels, grids, layout, tower_step, lambda grid: (settings, 0, 0))
    for image, groups in zip(images, kept, strict=True):
        # The rule on the image's own [0, 1] pixels (exact equality survives any injective normalisation).
        units = group_pixels(_packed(image).float() / 255, channels=CHANNELS, temporal_patch_size=TEMPORAL,
                             patch_size=PATCH, merge=MERGE_SIZE**2, mean=(0.0,) * 3, std=(1.0,) * 3)
        rows, cols = image.shape[1] // 8, image.shape[2] // 8
        flags = keep_map(units.view(1, rows, cols, -1)).flatten()
        assert groups.tolist() == flags.nonzero()[:, 0].tolist()
        assert 1 <= len(groups) < rows * cols  # the flat band and block are gone, the first group stays
    assert len(kept[2]) != len(kept[0])
