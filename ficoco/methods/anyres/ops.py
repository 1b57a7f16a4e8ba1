"""Where an AnyRes image's visual tokens sit in the LLM's span (LLaVA-NeXT and LLaVA-OneVision), and how the
items a method reduced before the LLM are packed there: plain arithmetic on the base view, the crop grid, its
unpadding and (OneVision) its anyres_max_N downscale, with torch for the packing. It knows no model class: ficoco's
transformers adapters (ficoco.models.llava_next, .llava_onevision) and the vLLM plugin (ficoco.serving.vllm.llava)
build a layout from the grid their own library chose and pack with it, so the two pack alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ficoco.accounting.families.llava_onevision import onevision_downscaled
from ficoco.errors import FicocoError
from ficoco.methods.inputs import TokenGrid

__all__ = ["ImageLayout", "OnevisionLayout", "anyres_layout", "unpadded_window"]


@dataclass(frozen=True)
class ImageLayout:
    """Where one image's visual tokens sit in the LLM's span, as LLaVA-NeXT packs them.

    The span is the base view's `side x side` tokens, then the unpadded rows of the crop grid
    (`rows x cols` patches before unpadding), each row followed by one newline token. Without
    crops (one item) the span is the base view and one newline.
    """

    family: ClassVar[str] = "LLaVA-NeXT"  # named in refusals
    side: int  # patches per item along each axis
    crops_hw: tuple[int, int]  # crops along each axis; (0, 0) when the base view is the only item
    unpadded: Tensor  # (rows_u, cols_u) flat indices into the rows x cols crop grid that unpadding keeps

    @property
    def items(self) -> int:
        return 1 + self.crops_hw[0] * self.crops_hw[1]

    @property
    def grid_hw(self) -> tuple[int, int]:
        return self.crops_hw[0] * self.side, self.crops_hw[1] * self.side

    @property
    def newline_rows(self) -> int:
        return self.unpadded.shape[0] if self.items > 1 else 1

    @property
    def unpadding_drops(self) -> int:
        rows, cols = self.grid_hw
        return rows * cols - self.unpadded.numel()

    @property
    def tokens(self) -> int:
        """Visual tokens of the unreduced image (the processor's placeholder count)."""
        return self.side * self.side + self.unpadded.numel() + self.newline_rows

    def reduced_tokens(self, placed_per_item: int, unplaced_per_item: int = 0, method: str = "FiCoCo-V") -> int:
        """Visual tokens when `method` hands on `placed_per_item` tokens with a grid place (kept or
        merged-into patches) and `unplaced_per_item` without one (contextual, extra) of every item:
        every item's tokens, and one newline per row of the crop grid. Refused where unpadding
        drops crop tokens: how many go would depend on which tokens stay."""
        if self.unpadding_drops:
            raise FicocoError(
                f"{method} on {self.family}: AnyRes unpadding of this image drops {self.unpadding_drops} crop "
                "tokens, so the reduced count depends on which tokens stay; use square images or FiCoCo-L")
        return self.items * (placed_per_item + unplaced_per_item) + self.newline_rows

    @property
    def crop_grid_hw(self) -> tuple[int, int]:
        """(rows, cols) of the packed crop grid's tokens as the span holds them (unpadded; each row then a newline)."""
        rows, cols = self.unpadded.shape
        return int(rows), int(cols)

    def token_grids(self, start: int) -> tuple[TokenGrid, ...]:
        """The grids of the image's tokens from span index `start`: the base view's, then (with crops) the packed
        crop grid's, one newline after each of its rows (the newlines lie on no grid)."""
        base = TokenGrid(start, self.side, self.side, self.side)
        if self.items == 1:
            return (base,)
        rows, cols = self.crop_grid_hw
        return base, TokenGrid(start + self.side * self.side, rows, cols, cols + 1)

    def newline_flags(self) -> Tensor:
        """(tokens,) bool: True on the newline tokens of the unreduced span."""
        flags = torch.zeros(self.tokens, dtype=torch.bool)
        base = self.side * self.side
        if self.items == 1:
            flags[base] = True
            return flags
        cols_u = self.unpadded.shape[1]
        flags[base + cols_u::cols_u + 1] = True
        return flags

    def crop_slots(self) -> Tensor:
        """(rows * cols,) long: the place of every crop-grid patch in the crop part of the packed
        span (rows of cols_u patches and one newline), -1 where unpadding drops the patch."""
        rows, cols = self.grid_hw
        rows_u, cols_u = self.unpadded.shape
        slots = torch.full((rows * cols,), -1, dtype=torch.long)
        place = torch.arange(rows_u)[:, None] * (cols_u + 1) + torch.arange(cols_u)[None, :]
        slots[self.unpadded.flatten()] = place.flatten()
        return slots

    def grid_order(self) -> Tensor:
        """(rows_u * cols_u,) long: the crop-grid tokens in the packed span's order (the unpadded grid row-major),
        as indices into the crops' features laid out crop after crop, patches row-major."""
        crops_w, side = self.crops_hw[1], self.side
        full = self.unpadded.flatten()
        row, col = full // self.grid_hw[1], full % self.grid_hw[1]
        crop = (row // side) * crops_w + col // side
        return crop * side * side + (row % side) * side + col % side

    def grid_slots(self) -> Tensor:
        """(rows_u * cols_u,) long: the place in the span of every crop-grid token of `grid_order` (after the
        base view; one newline ends every row)."""
        rows_u, cols_u = self.unpadded.shape
        tokens = torch.arange(rows_u * cols_u)
        return self.side * self.side + tokens // cols_u * (cols_u + 1) + tokens % cols_u

    def newline_slots(self) -> Tensor:
        """(newline_rows,) long: the places of the newline tokens in the span."""
        return torch.nonzero(self.newline_flags()).flatten()

    def pack(self, features: Tensor, kept: Tensor, newline: Tensor | None) -> Tensor:
        """Pack one image's reduced item features in AnyRes order: one function for FiCoCo-V (every
        token placed) and the methods that cut before the LLM (some tokens without a grid place).

        Args:
            features: (items, k, D) projected features of every item, in the method's output order.
            kept: (items, k) the original grid index (row-major within its item) of each token, -1
                for a token without a grid place (merged from many, contextual, extra).
            newline: (D,) the newline embedding, or None (then no newline tokens, as transformers).

        Returns:
            The base view's tokens in the method's order; then the crops' placed tokens at their
            places in the unpadded crop grid, one newline ending every row (rows that lost tokens
            keep theirs); then every crop's unplaced tokens, crop by crop, each crop's in its
            order. Every token placed: (items * k + newline rows, D), the unreduced model's order.
        """
        base = features[0]
        if newline is not None:
            newline = newline.to(device=features.device, dtype=features.dtype)
        if self.items == 1:
            return base if newline is None else torch.cat([base, newline[None]], dim=0)
        crops, grid = features[1:], kept[1:].to(features.device)
        crop_count, per_crop = grid.shape
        crop_index = torch.arange(crop_count, device=grid.device)[:, None]
        placed = grid >= 0
        cell = grid.clamp(min=0)
        crops_w = self.crops_hw[1]
        rows_in, cols_in = cell // self.side, cell % self.side
        grid_row = (crop_index // crops_w) * self.side + rows_in
        grid_col = (crop_index % crops_w) * self.side + cols_in
        slots = self.crop_slots().to(grid.device)[grid_row * self.grid_hw[1] + grid_col]
        # Unplaced tokens sort after the whole grid (its rows and newlines), in crop order.
        rows_u, cols_u = self.unpadded.shape
        after_grid = rows_u * (cols_u + 1) + torch.arange(crop_count * per_crop, device=grid.device)
        slots = torch.where(placed, slots, after_grid.view(crop_count, per_crop)).flatten()
        tokens = crops.reshape(-1, crops.shape[-1])
        if bool((slots < 0).any()):  # placed where unpadding drops (the entry refuses such images for cuts)
            tokens, slots = tokens[slots >= 0], slots[slots >= 0]
        if newline is not None:
            newline_slots = torch.arange(rows_u, device=grid.device) * (cols_u + 1) + cols_u
            tokens = torch.cat([tokens, newline[None].expand(rows_u, -1)], dim=0)
            slots = torch.cat([slots, newline_slots])
        order = torch.argsort(slots)
        return torch.cat([base, tokens[order]], dim=0)


def unpadded_window(rows: int, cols: int, size_hw: list[int]) -> tuple[slice, slice]:
    """The rows and columns of a rows x cols grid that transformers' `unpad_image` keeps for an
    image of `size_hw`, in plain integers (unpad_image rounds tensor sizes under torch.jit)."""
    height, width = size_hw
    if width / height > cols / rows:
        new_height = int(round(height * (cols / width), 7))
        pad = (rows - new_height) // 2
        return slice(pad, rows - pad), slice(0, cols)
    new_width = int(round(width * (rows / height), 7))
    pad = (cols - new_width) // 2
    return slice(0, rows), slice(pad, cols - pad)


@dataclass(frozen=True)
class OnevisionLayout(ImageLayout):
    """Where one image's visual tokens sit in the LLM's span, as LLaVA-OneVision packs them: LLaVA-NeXT's
    layout, except that an unpadded crop grid over the anyres_max_N budget is resized to `packed_hw`."""

    family: ClassVar[str] = "LLaVA-OneVision"
    packed_hw: tuple[int, int] | None = None  # the crop grid after the bilinear downscale; None: not resized
    budget: int = 9  # N of anyres_max_N

    @property
    def downscaled(self) -> bool:
        return self.packed_hw is not None

    @property
    def newline_rows(self) -> int:
        return self.packed_hw[0] if self.packed_hw is not None else super().newline_rows

    @property
    def crop_grid_hw(self) -> tuple[int, int]:
        return self.packed_hw if self.packed_hw is not None else super().crop_grid_hw

    @property
    def tokens(self) -> int:
        if self.packed_hw is None:
            return super().tokens
        rows, cols = self.packed_hw
        return self.side * self.side + rows * cols + rows

    def resampled_note(self) -> str:
        rows_u, cols_u = self.unpadded.shape
        assert self.packed_hw is not None
        return (f"the packed crop grid ({rows_u}x{cols_u}) exceeds anyres_max_{self.budget} and is downscaled "
                f"bilinearly to {self.packed_hw[0]}x{self.packed_hw[1]}, which needs the whole grid")

    def reduced_tokens(self, placed_per_item: int, unplaced_per_item: int = 0, method: str = "FiCoCo-V") -> int:
        if self.packed_hw is not None:
            raise FicocoError(f"{method} on LLaVA-OneVision: {self.resampled_note()}; use a smaller image or a "
                              "method inside the LLM (FiCoCo-L)")
        return super().reduced_tokens(placed_per_item, unplaced_per_item, method)

    def newline_flags(self) -> Tensor:
        if self.packed_hw is None:
            return super().newline_flags()
        flags = torch.zeros(self.tokens, dtype=torch.bool)
        cols = self.packed_hw[1]
        flags[self.side * self.side + cols::cols + 1] = True
        return flags

    def pack_resized(self, features: Tensor, newline: Tensor | None) -> Tensor:
        """Every item's whole grid packed as transformers packs a downscaled image (crops to one grid,
        unpadded, resized bilinearly, a newline after every row), in plain integers so that torch.jit
        can trace it (transformers' unpadding rounds traced sizes)."""
        assert self.packed_hw is not None
        crops_h, crops_w = self.crops_hw
        side, dim = self.side, features.shape[-1]
        grid = features[1:].view(crops_h, crops_w, side, side, dim).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(dim, crops_h * side * crops_w * side)[:, self.unpadded.flatten().to(features.device)]
        grid = grid.view(1, dim, *self.unpadded.shape)
        grid = torch.nn.functional.interpolate(grid, list(self.packed_hw), mode="bilinear")[0]
        if newline is not None:
            column = newline.to(features.device, features.dtype)[:, None, None].expand(dim, self.packed_hw[0], 1)
            grid = torch.cat([grid, column], dim=-1)
        return torch.cat([features[0], grid.flatten(1, 2).transpose(0, 1)], dim=0)

    def pack(self, features: Tensor, kept: Tensor, newline: Tensor | None) -> Tensor:
        if self.packed_hw is not None:
            raise FicocoError(f"a method that cuts before the LLM on LLaVA-OneVision: {self.resampled_note()}")
        return super().pack(features, kept, newline)


def anyres_layout(side: int, crops_hw: tuple[int, int] | None, size_hw: list[int], budget: int | None = None
                  ) -> ImageLayout:
    """The layout of one image of `size_hw` (H, W) whose AnyRes grid is `crops_hw` (None: its base view alone), `side`
    patches per item along each axis: LLaVA-NeXT's (`budget` None) or LLaVA-OneVision's with its anyres_max_`budget`
    downscale."""
    if crops_hw is None:
        empty = torch.zeros(0, 0, dtype=torch.long)
        return ImageLayout(side, (0, 0), empty) if budget is None else OnevisionLayout(side, (0, 0), empty)
    crops_h, crops_w = crops_hw
    rows, cols = crops_h * side, crops_w * side
    keep_rows, keep_cols = unpadded_window(rows, cols, size_hw)
    unpadded = torch.arange(rows * cols).view(rows, cols)[keep_rows, keep_cols]
    if budget is None:
        return ImageLayout(side, (crops_h, crops_w), unpadded)
    rows_u, cols_u = unpadded.shape
    packed = onevision_downscaled(rows_u, cols_u, side, budget)
    return OnevisionLayout(side, (crops_h, crops_w), unpadded, packed if packed != (rows_u, cols_u) else None, budget)
