"""The prompt once the tower ran a method before the LLM on Qwen2-VL: every image's (or video's: under a video
method, or a method that reduced each temporal slice as an image) placeholder span shortened to the groups the
tower kept, the kept tokens at the 3-D
positions the unreduced prompt gives them (transformers' `get_rope_index` on the unreduced prompt),
and the `rope_deltas` that put the next token where the unreduced model would. Later turns on a cache
continue after what it holds (`continue_prompt`, `cached_part`); a text turn's prompt is shortened as
the cache holds it (`text_turn`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models.patching import span_lengths

if TYPE_CHECKING:
    from ficoco.models.entry import Entry
    from ficoco.models.qwen2_vl.adapter import Qwen2VLAdapter


class PromptShortener:
    """Rewrites a call's `input_ids`, masks, 3-D positions and `rope_deltas` once the tower's method removed
    visual tokens, from the groups every item kept (`adapter.tower_pass.kept_groups`)."""

    def __init__(self, adapter: Qwen2VLAdapter) -> None:
        self.adapter = adapter

    def shorten_prompt(self, input_ids: Tensor, attention_mask: Tensor | None, mm_token_type_ids: Tensor | None,
                       image_grid_thw: Tensor, kept_groups: list[Tensor], position_ids: Tensor | None = None,
                       *, video: bool = False, second_per_grid_ts: Tensor | None = None
                       ) -> tuple[dict[str, Tensor | None], Tensor, Tensor]:
        """Shorten every image's placeholder span to its kept groups (`video`: every video's span, to the
        units of its temporal slices it kept; `image_grid_thw` is then `video_grid_thw`, and Qwen2.5-VL's
        `second_per_grid_ts` scale its temporal positions).

        Returns the shortened `input_ids`, `attention_mask`, `mm_token_type_ids` and 3-D
        `position_ids` (3, B, T'): the positions the unreduced prompt gives the kept tokens
        (transformers' `get_rope_index` on the unreduced prompt, or the caller's own
        unreduced position ids, sliced), the `rope_deltas` (B, 1) that place the token
        after the shortened prompt where it follows the unreduced one, and the (B, T') position
        in `input_ids` of every token of the shortened prompt.
        """
        adapter = self.adapter
        batch, length = input_ids.shape
        device = input_ids.device
        is_image = input_ids == (adapter.video_token_id if video else adapter.image_token_id)
        if mm_token_type_ids is None:
            mm_token_type_ids = (input_ids == adapter.image_token_id).int()
            if adapter.video_token_id is not None:
                mm_token_type_ids = mm_token_type_ids + 2 * (input_ids == adapter.video_token_id).int()
        grids = [(int(t), int(t * h * w) // adapter.merge) for t, h, w in image_grid_thw.tolist()]
        groups = [count for _, count in grids]
        # Spans in reading order, sample after sample: the order of image_grid_thw's rows.
        starts = is_image & ~F.pad(is_image[:, :-1], (1, 0), value=False)
        span = (starts.flatten().long().cumsum(0) - 1).view(batch, length)
        positions = torch.arange(length, device=device).expand(batch, -1)
        span_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
        rank = positions - span_start
        span_lengths = torch.bincount(span[is_image]).tolist() if bool(is_image.any()) else []
        # One span per image (or video); a video laid out slice by slice (Qwen3-VL's processor: every temporal slice
        # after its timestamp, between its own markers) has one span per slice, its units slice after slice.
        pieces = [1] * len(grids)
        if video and span_lengths != groups and span_lengths == [count // t for t, count in grids for _ in range(t)]:
            pieces = [t for t, _ in grids]
        elif span_lengths != groups:
            raise FicocoError(f"the prompt's image spans hold {span_lengths} placeholders, image_grid_thw asks for "
                              f"{groups} (one per merge group): give the unreduced prompt")
        # How many tokens every placeholder becomes: 1 kept, 0 removed; a video method may hand on two tokens at one
        # unit (FlashVID's cluster centred on a token it keeps as well): its placeholder twice, at one position.
        widest = max(span_lengths)
        table = torch.zeros(len(span_lengths), widest, dtype=torch.long, device=device)
        first = 0
        for image, kept in enumerate(kept_groups):
            kept, size = kept.to(device), groups[image] // pieces[image]
            table.index_put_((first + kept // size, kept % size), torch.ones_like(kept), accumulate=True)
            first += pieces[image]
        times = torch.where(is_image, table[span.clamp(min=0), rank.clamp(0, widest - 1)], 1)
        counts = times.sum(dim=1)
        fewest, most = (int(n) for n in torch.stack([counts.min(), counts.max()]).tolist())
        if fewest != most and adapter.removed_per_image is not None:
            raise FicocoError(f"FiCoCo-V on {adapter.family_title}: every sample of a batch must lose the "
                              "same number of "
                              "placeholders (the same number of images)")
        if position_ids is None:
            grids = (None, image_grid_thw) if video else (image_grid_thw, None)
            position_ids, deltas = hf.rope_index(adapter.model, input_ids, mm_token_type_ids, grids[0], attention_mask,
                                                 video_grid_thw=grids[1], second_per_grid_ts=second_per_grid_ts)
        else:
            # A 4-row tensor's first row is plain text order; a 2-D one is the same on all three axes.
            position_ids = position_ids[-3:] if position_ids.dim() == 3 else position_ids[None]
            position_ids = position_ids.expand(3, batch, length)
            real = attention_mask.bool() if attention_mask is not None else torch.ones_like(is_image)
            last = torch.where(real, position_ids.amax(dim=0), torch.zeros_like(position_ids[0])).amax(dim=1)
            deltas = (last + 1 - real.sum(dim=1)).unsqueeze(1)
        if fewest != most:  # each image its own count (PixelPrune): the shorter prompts left-padded
            return self._left_padded(times > 0, counts, most, input_ids, attention_mask, mm_token_type_ids,
                                     position_ids, deltas)
        removed = (length - counts).unsqueeze(1)
        # Every kept position in order, a placeholder held twice repeated (sample-major: every sample keeps as many).
        offsets = torch.arange(batch, device=device).unsqueeze(1) * length
        kept_index = torch.repeat_interleave((positions + offsets).flatten(), times.flatten()).view(batch, -1) - offsets
        short = {
            "input_ids": torch.gather(input_ids, 1, kept_index),
            "attention_mask": torch.gather(attention_mask, 1, kept_index) if attention_mask is not None else None,
            "mm_token_type_ids": torch.gather(mm_token_type_ids, 1, kept_index),
            "position_ids": torch.gather(position_ids, 2, kept_index.unsqueeze(0).expand(3, -1, -1)),
        }
        return short, deltas.to(device) + removed, kept_index

    def _left_padded(self, keep: Tensor, counts: Tensor, width: int, input_ids: Tensor, attention_mask: Tensor | None,
                     mm_token_type_ids: Tensor, position_ids: Tensor, deltas: Tensor
                     ) -> tuple[dict[str, Tensor | None], Tensor, Tensor]:
        """`shorten_prompt`'s result where the samples keep different counts (a method whose count is each
        image's own: PixelPrune): every shortened prompt left-padded to the longest (the pad token, mask 0,
        position 1 as transformers' own layout pads), as the official code pads (patches/qwen3_vl_hf.py:271-283).
        The kept-position row of a pad is -1 (it stands for no token of the caller's prompt); every sample's
        `rope_deltas` place its next token where its unreduced prompt's would, after the padded length."""
        adapter = self.adapter
        batch, length = input_ids.shape
        device = input_ids.device
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # every row's kept positions first
        source = torch.arange(width, device=device).unsqueeze(0) - (width - counts).unsqueeze(1)
        real = source >= 0
        kept_index = torch.where(real, torch.gather(order, 1, source.clamp(min=0)), torch.full_like(source, -1))
        index = kept_index.clamp(min=0)
        pad_id = getattr(adapter.model.config, "pad_token_id", None)
        pad_id = pad_id if pad_id is not None else getattr(getattr(adapter.model.config, "text_config", None),
                                                           "pad_token_id", None)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)

        def take(values: Tensor, pad: int) -> Tensor:
            return torch.where(real, torch.gather(values, 1, index), torch.full_like(index, pad).to(values.dtype))

        short = {
            "input_ids": take(input_ids, 0 if pad_id is None else int(pad_id)),
            "attention_mask": take(mask, 0),
            "mm_token_type_ids": take(mm_token_type_ids, 0),
            "position_ids": torch.where(real, torch.gather(position_ids, 2, index.expand(3, -1, -1)),
                                        torch.ones_like(position_ids[:, :, :1])),
        }
        return short, deltas.to(device) + (length - width), kept_index

    def cached_part(self, is_image: Tensor, past: int) -> tuple[Tensor, int]:
        """Where a whole conversation (`is_image` its placeholders) continues after the `past`
        tokens a FiCoCo-V cache holds of it: (B, T') the positions of the conversation as this
        handle shortens it (every image span loses its last `removed_per_image` placeholders;
        the ids are all the placeholder's, whichever groups stayed), and the position in the
        conversation of its first token the cache lacks."""
        adapter = self.adapter
        if adapter.removed_per_image is None:
            raise FicocoError(f"{adapter.family_title}: every image of the earlier turns kept its own count (a "
                              "method decided by the pixels), so the cache's layout is not known from the "
                              "conversation: give the whole conversation with its images in one prompt")
        length = is_image.shape[1]
        flags = F.pad(is_image.long(), (0, adapter.removed_per_image))
        run = flags.cumsum(dim=1)
        ahead = run[:, adapter.removed_per_image:] - run[:, :length]  # placeholders among the next r tokens
        drop = is_image & (ahead < adapter.removed_per_image)
        dropped = drop.sum(dim=1)
        short_length = length - int(dropped.max())
        if past >= short_length or not bool((dropped == length - short_length).all()):
            raise FicocoError(f"the cache holds {past} tokens, which is not the start of this conversation as "
                              "FiCoCo-V shortened it: give the whole conversation's input_ids (its earlier turns "
                              "run under this handle) and the new turn's images")
        kept_all = torch.sort(drop.to(torch.int8), dim=1, stable=True).indices[:, :short_length]
        starts = kept_all[:, past]
        start = int(starts[0])
        if not bool((starts == start).all()) or bool((is_image[:, start - 1] & is_image[:, start]).any()):
            raise FicocoError("the cache ends inside an image span or at different places of the samples: give the "
                              "whole conversation's input_ids and the new turn's images")
        return kept_all, start

    def continue_prompt(self, call: dict[str, Any], pixel_values: Tensor | None, past: int, *, whole: bool
                        ) -> tuple[dict[str, Tensor | None], Tensor, Tensor, Any]:
        """FiCoCo-V's shortened prompt of a later turn, on a cache that holds `past` tokens of the
        earlier turns (shortened by this handle: every earlier image lost `removed_per_image`
        placeholders). `pixel_values` are this turn's images.

        `whole`: `input_ids` is the whole conversation (generate's convention), and the shortened
        prompt is too; its first `past` tokens stand for what the cache holds (generate runs
        the rest). Otherwise `input_ids` is what follows the cache (a forward's convention; the
        attention mask may cover the cache as well). `image_grid_thw` holds this turn's images,
        or every image of the conversation (as transformers' 3-D positions need them); the
        kept tokens get the positions the unreduced conversation gives them: from every image's
        grid, or after the earlier turns' last position (their `rope_deltas`).

        Returns what `shorten_prompt` returns, for the whole prompt (kept positions in the
        caller's `input_ids`), and the encoded images.
        """
        adapter = self.adapter
        input_ids, grid = call["input_ids"], call["image_grid_thw"]
        mask, types = call.get("attention_mask"), call.get("mm_token_type_ids")
        batch, length = input_ids.shape
        is_image = input_ids == adapter.image_token_id
        if types is None:
            types = is_image.int()
        spans = span_lengths(is_image)
        start, prefix = 0, None
        if whole:
            kept_all, start = self.cached_part(is_image, past)
            prefix = kept_all[:, :past]
        new_ids, new_types = input_ids[:, start:], types[:, start:]
        new_mask = None
        if mask is not None:
            new_mask = mask[:, past:] if not whole and mask.shape[1] == past + length else mask[:, start:]
        new_spans = span_lengths(new_ids == adapter.image_token_id)
        images = len(new_spans[0])
        per_sample, rest = divmod(grid.shape[0], batch)
        if rest or per_sample < images or any(len(row) != images for row in new_spans):
            raise FicocoError(f"this turn's image spans hold {new_spans} placeholders, but image_grid_thw has "
                              f"{grid.shape[0]} rows: give this turn's images' grids, or every image's")
        new_grid = grid.view(batch, per_sample, 3)[:, per_sample - images:].reshape(-1, 3)
        patches = int(new_grid.prod(dim=-1).sum())
        if pixel_values is None or pixel_values.shape[0] != patches:
            held = "no pixel_values" if pixel_values is None else f"pixel_values of {pixel_values.shape[0]} patches"
            raise FicocoError(f"{held} for this turn's images of {patches} patches: give the pixel values of the "
                              "images after what the cache holds")
        encoded = adapter.encode_images(pixel_values, new_grid)
        if whole and all(len(row) == per_sample for row in spans):  # every image's grid: the whole layout
            full_mask = mask if mask is not None and mask.shape[1] == length else None
            positions = hf.rope_index(adapter.model, input_ids, types, grid, full_mask)[0][:, :, start:]
        else:
            earlier = adapter.turn_deltas.get(hf.cache_in(call), hf.rope_deltas(adapter.model))
            if earlier is None or batch % earlier.shape[0]:
                raise FicocoError(f"FiCoCo-V on {adapter.family_title} continues a conversation after the "
                                  "earlier turns' positions "
                                  "(rope_deltas of the turn that filled the cache); give every image's "
                                  "image_grid_thw with the whole conversation's input_ids")
            local = hf.rope_index(adapter.model, new_ids, new_types, new_grid, new_mask)[0]
            offset = past + earlier.repeat_interleave(batch // earlier.shape[0], dim=0).to(local.device)
            positions = local + offset.view(1, batch, 1)
        short, deltas, kept = self.shorten_prompt(new_ids, new_mask, new_types, new_grid,
                                                  adapter.tower_pass.kept_groups, positions)
        # shorten_prompt's deltas place the next token after this part alone; the cache precedes it.
        deltas = deltas - past
        if not whole:
            if mask is not None and mask.shape[1] == past + length:
                short["attention_mask"] = torch.cat([mask[:, :past], short["attention_mask"]], dim=1)
            return short, deltas, kept, encoded
        # generate slices off what the cache holds before any forward: the prefix's positions are
        # never read; text order stands in for them.
        cached_positions = torch.arange(past, device=input_ids.device).expand(3, batch, -1)
        short = {
            "input_ids": torch.cat([torch.gather(input_ids, 1, prefix), short["input_ids"]], dim=1),
            "attention_mask": None if mask is None else torch.cat([torch.gather(mask, 1, prefix),
                                                                   short["attention_mask"]], dim=1),
            "mm_token_type_ids": torch.cat([torch.gather(types, 1, prefix), short["mm_token_type_ids"]], dim=1),
            "position_ids": torch.cat([cached_positions.to(short["position_ids"]), short["position_ids"]], dim=2),
        }
        return short, deltas, torch.cat([prefix, kept + start], dim=1), encoded

    def encode_later_turn_images(self, kwargs: dict[str, Any]) -> None:
        """FiCoCo-L's generate on a later turn's cache, with new images: transformers computes the
        whole conversation's 3-D positions there, so it needs every image's `image_grid_thw`, and
        takes the new images only encoded beforehand (`mm_encoder_outputs`; the tower would read
        every grid against the new pixels). Given `pixel_values` of the new images and every
        image's grid, encode the new ones with their own grids (in `kwargs`), as that form has it;
        given the new images' grids alone, refuse at the call (transformers would stop inside)."""
        adapter = self.adapter
        cache, input_ids = hf.cache_in(kwargs), kwargs.get("input_ids")
        grid, pixel_values = kwargs.get("image_grid_thw"), kwargs.get("pixel_values")
        past = int(cache.get_seq_length()) if cache is not None else 0
        if not past or input_ids is None or grid is None or input_ids.shape[1] <= past:
            return
        batch = input_ids.shape[0]
        every = span_lengths(input_ids == adapter.image_token_id)
        new = span_lengths(input_ids[:, past:] == adapter.image_token_id)
        images = len(new[0])
        if grid.shape[0] != batch * len(every[0]) or any(len(row) != len(every[0]) for row in every):
            raise FicocoError(f"FiCoCo-L on {adapter.family_title}: image_grid_thw has {grid.shape[0]} rows "
                              "for a conversation "
                              f"of image spans {every}; on an earlier turn's cache give every image's grid, "
                              "earlier turns' first (transformers' 3-D positions count them all)")
        if pixel_values is not None and images:
            new_grid = grid.view(batch, -1, 3)[:, len(every[0]) - images:].reshape(-1, 3)
            if pixel_values.shape[0] != int(new_grid.prod(dim=-1).sum()):
                raise FicocoError(f"FiCoCo-L on {adapter.family_title}: pixel_values of "
                                  f"{pixel_values.shape[0]} patches for this "
                                  f"turn's images of grids {new_grid.tolist()}: give the images after what the "
                                  "cache holds")
            encoded = hf.encode_features(adapter.model, hf.IMAGE_ENCODER, kwargs.pop("pixel_values"), new_grid)
            features = hf.ENCODED_FEATURES_KEYWORD
            kwargs[features] = {**(kwargs.get(features) or {}), "image": encoded}

    def prepare(self, entry: Entry, call: dict[str, Any], *, text_row: bool) -> None:
        """Encode the images, shorten the prompt and set its positions (in `call`)."""
        adapter = self.adapter
        if adapter.video_cut or call.get("pixel_values_videos") is not None:
            self._prepare_video(entry, call, text_row=text_row)
            return
        handle = entry.handle
        pixel_values = call.pop("pixel_values", None)
        input_ids = call.get("input_ids")
        grid = call.get("image_grid_thw")
        if input_ids is None or grid is None:
            raise FicocoError(f"FiCoCo-V on {adapter.family_title} needs input_ids and image_grid_thw with "
                              "pixel_values "
                              "(the image spans are shortened in input_ids)")
        handle.begin_forward()
        handle.prompt_ids = (input_ids, call.get("attention_mask"))  # a method that reads the instruction
        cache = hf.cache_in(call)
        past = int(cache.get_seq_length()) if cache is not None else 0
        if past:  # a later turn of a conversation whose earlier turns the cache holds
            short, deltas, kept, encoded = self.continue_prompt(call, pixel_values, past, whole=text_row)
        else:
            encoded = adapter.encode_images(pixel_values, grid)
            short, deltas, kept = self.shorten_prompt(input_ids, call.get("attention_mask"),
                                                      call.get("mm_token_type_ids"), grid,
                                                      adapter.tower_pass.kept_groups, call.get("position_ids"))
        self._finish(entry, call, short, deltas, kept, "image", encoded, text_row=text_row)

    def _prepare_video(self, entry: Entry, call: dict[str, Any], *, text_row: bool) -> None:
        """The prompt of the videos a method before the LLM reduced: a video method's (the cut runs in the tower's
        forward, on a video's slices together) or a method that reduces every temporal slice as an image (the
        encoder runs the slices through the tower as images, `GridOrder.slice_items`); encode the videos, shorten
        every video span to the units it kept, at their unreduced 3-D positions."""
        adapter = self.adapter
        title = f"{entry.spec.title} on {adapter.family_title}"
        if call.get("pixel_values") is not None and adapter.video_cut:
            raise FicocoError(f"{title} acts on a video's frames; an image is one frame: give the image as a "
                              "video, or a method that reduces images")
        if call.get("pixel_values") is not None:
            raise FicocoError(f"{title} reduces images and videos, one kind per call: give the images and the videos "
                              "in separate prompts")
        if not adapter.video_cut and not adapter.video_slices:
            raise FicocoError(f"{title} reduces images only: {adapter.video_refusal}; run the video unreduced, or "
                              "with a method that reduces every temporal slice (v, visionzip, divprune, `ficoco "
                              "methods`)")
        pixel_values = call.pop("pixel_values_videos")
        input_ids, grid = call.get("input_ids"), call.get("video_grid_thw")
        if input_ids is None or grid is None:
            raise FicocoError(f"{title} needs input_ids and video_grid_thw with pixel_values_videos (the video "
                              "spans are shortened in input_ids)")
        cache = hf.cache_in(call)
        if cache is not None and int(cache.get_seq_length()):
            raise FicocoError(f"{title}: a video on a later turn's cache is not supported; give the video in the "
                              "conversation's first turn")
        entry.handle.begin_forward()
        entry.handle.prompt_ids = (input_ids, call.get("attention_mask"))
        encoded = adapter.encode_images(pixel_values, grid)
        short, deltas, kept = self.shorten_prompt(input_ids, call.get("attention_mask"),
                                                  call.get("mm_token_type_ids"), grid, adapter.tower_pass.kept_groups,
                                                  call.get("position_ids"), video=True,
                                                  second_per_grid_ts=call.get("second_per_grid_ts"))
        self._finish(entry, call, short, deltas, kept, "video", encoded, text_row=text_row)

    def _finish(self, entry: Entry, call: dict[str, Any], short: dict[str, Tensor | None], deltas: Tensor,
                kept: Tensor, modality: str, encoded: Any, *, text_row: bool) -> None:
        """Put the shortened prompt, its positions and the encoded features into `call`; the kept positions
        go to the forward that runs it (generate's prefill runs later, inside generate)."""
        adapter = self.adapter
        input_ids = call["input_ids"]
        if isinstance(call.get("labels"), Tensor) and call["labels"].shape == input_ids.shape:
            labels, at = call["labels"], kept.to(call["labels"].device)
            # A pad the shortening added (-1: samples of different counts) is ignored by the loss.
            short["labels"] = torch.where(at >= 0, torch.gather(labels, 1, at.clamp(min=0)),
                                          torch.full_like(at, -100))
        entry.generating = (kept, input_ids.shape[1])
        if text_row:
            # generate keeps a 4th (first) row of plain text order for its masks and extends all
            # four by one per new token; that row follows the shortened prompt.
            mask = short["attention_mask"]
            if mask is None:
                text = torch.arange(short["input_ids"].shape[1], device=input_ids.device)
                text = text.expand(short["input_ids"].shape[0], -1)
            else:
                text = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
            short["position_ids"] = torch.cat([text[None].to(short["position_ids"]), short["position_ids"]])
        call.update({k: v for k, v in short.items() if v is not None or k in call})
        features = hf.ENCODED_FEATURES_KEYWORD
        call[features] = {**(call.get(features) or {}), modality: encoded}
        # Decode steps that come without position ids take them from here (and the cache length).
        hf.set_rope_deltas(adapter.model, deltas)

    def text_turn(self, entry: Entry, kwargs: dict[str, Any]) -> bool:
        """generate without images: on a cache of earlier turns with images, the whole conversation
        as this handle shortened it (the cache holds that), so that generate runs what follows; True
        when it shortened the prompt (in `kwargs`)."""
        adapter = self.adapter
        cache, prompt = hf.cache_in(kwargs), kwargs.get("input_ids")
        past = int(cache.get_seq_length()) if cache is not None else 0
        if past and prompt is not None and adapter.video_token_id is not None and \
                bool((prompt == adapter.video_token_id).any()):
            raise FicocoError(f"{entry.spec.title} on {adapter.family_title}: a later turn on a video's cache is "
                              "not supported; run the whole conversation in one prompt")
        if not past or prompt is None or not bool((prompt == adapter.image_token_id).any()):
            return False
        kept, _ = self.cached_part(prompt == adapter.image_token_id, past)
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            value = kwargs.get(key)
            if isinstance(value, Tensor) and value.shape == prompt.shape:
                kwargs[key] = torch.gather(value, 1, kept.to(value.device))
        return True
