"""Tiny local checkpoints, made offline: a tiny profile's random model (save_pretrained), a
byte-level tokenizer made here (the family's special tokens at the ids its config names) and
the family's processor config with a chat template in the style of the real checkpoint's.

Nothing is downloaded: the tokenizer is built with `tokenizers`, the processors from their
classes, and the model from the profile with ficoco's seeded random fill.
"""

from __future__ import annotations

from pathlib import Path

# Chat templates written for these checkpoints in the form the real ones lay out: LLaVA-1.5 and
# Video-LLaVA "USER: <image>\n{text} ASSISTANT:", LLaVA-NeXT (vicuna) "USER: <image>\n{text}
# ASSISTANT:", Qwen2-VL ChatML with <|vision_start|><|image_pad|><|vision_end|>.
_USER_ASSISTANT = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# LLaVA-OneVision (Qwen2's ChatML, "<image>\n" before the text, as llava-hf's template lays it out).
_ONEVISION_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Family -> (profile, special tokens by id).
FAMILIES = {
    "llava": ("llava-tiny", {300: "<image>", 301: "<pad>"}),
    "llava_next": ("llava-next-tiny", {300: "<image>", 301: "<pad>"}),
    "video_llava": ("video-llava-tiny", {300: "<image>", 301: "<video>", 302: "<pad>"}),
    "llava_onevision": ("llava-onevision-tiny", {300: "<image>", 301: "<video>", 302: "<|im_start|>",
                                                 303: "<|im_end|>", 304: "<pad>"}),
    "qwen2_vl": ("qwen2-vl-tiny", {300: "<|image_pad|>", 301: "<|video_pad|>", 302: "<|vision_start|>",
                                   303: "<|vision_end|>", 304: "<|im_start|>", 305: "<|im_end|>", 306: "<pad>"}),
}
FAMILIES["qwen2_5_vl"] = ("qwen2.5-vl-tiny", FAMILIES["qwen2_vl"][1])  # Qwen2-VL's tokens and processor


def make_tokenizer(specials: dict[int, str], vocab_size: int, *, add_bos: bool):
    """A byte-level tokenizer without merges: ids 0-2 <unk> <s> </s>, then the 256 byte symbols,
    the family's special tokens at their config ids, unused fillers up to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for index in range(len(vocab), vocab_size):
        vocab[specials.get(index, f"<unused_{index}>")] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if add_bos:  # LLaMA's tokenizer starts every prompt with <s>
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    pad = specials.get(max(specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token=pad)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials.values())})
    return tokenizer


def make_processor(family: str, model):
    """The family's processor for `model`'s config with the PIL image processors (no torchvision):
    the whole processor for LLaVA-1.5 and LLaVA-NeXT; for Qwen2-VL and Video-LLaVA, whose
    processors transformers 5 builds only with torchvision (they hold a video processor), the
    pieces a checkpoint stores: (tokenizer, image processor, chat template)."""
    config = model.config
    _, specials = FAMILIES[family]
    tokenizer = make_tokenizer(specials, config.get_text_config().vocab_size,
                               add_bos=family not in ("qwen2_vl", "qwen2_5_vl", "llava_onevision"))
    if family in ("qwen2_vl", "qwen2_5_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = config.vision_config
        images = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                          temporal_patch_size=vision.temporal_patch_size)
        return tokenizer, images, _CHATML
    side = config.vision_config.image_size
    if family == "llava_onevision":  # its whole processor needs torchvision (the video processor)
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        images = LlavaOnevisionImageProcessorPil(size={"height": side, "width": side},
                                                 crop_size={"height": side, "width": side},
                                                 image_grid_pinpoints=config.image_grid_pinpoints)
        return tokenizer, images, _ONEVISION_CHATML
    if family == "video_llava":
        from transformers import VideoLlavaImageProcessor

        images = VideoLlavaImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return tokenizer, images, _USER_ASSISTANT
    common = {"patch_size": config.vision_config.patch_size, "chat_template": _USER_ASSISTANT,
              "vision_feature_select_strategy": config.vision_feature_select_strategy,
              "num_additional_image_tokens": 1}
    if family == "llava":
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return LlavaProcessor(image_processor=images, tokenizer=tokenizer, **common)
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    images = LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                        image_grid_pinpoints=config.image_grid_pinpoints)
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, **common)


def make_checkpoint(family: str, folder: Path, *, processor: bool = True, chat_template: bool = True) -> Path:
    """Save the tiny model of `family` (random weights, float32) and, unless `processor` is
    False, its tokenizer, image processor and chat template into `folder`."""
    import ficoco

    profile, _ = FAMILIES[family]
    model = ficoco.build_model(profile, dtype="fp32", check_memory=False)
    model.save_pretrained(folder)
    if processor:
        made = make_processor(family, model)
        if isinstance(made, tuple):
            tokenizer, images, template = made
            tokenizer.save_pretrained(folder)
            images.save_pretrained(folder)
            if chat_template:
                (Path(folder) / "chat_template.jinja").write_text(template)
        else:
            if not chat_template:
                made.chat_template = None
            made.save_pretrained(folder)
    return folder
