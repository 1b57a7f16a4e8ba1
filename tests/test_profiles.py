"""Profiles: shapes and parameter counts agree with Hugging Face; loading, overrides, hardware."""

from __future__ import annotations

import copy
import functools
import json

import pytest

from ficoco.accounting import architecture, make_quant, parameter_counts
from ficoco.accounting.memory import weight_bytes
from ficoco.errors import FicocoError
from ficoco.profiles import PROFILES_DIR, list_gpus, list_profiles, load_gpu, load_profile, parse_overrides

PROFILES = [
    "llava-1.5-13b", "llava-1.5-7b", "llava-gqa-tiny", "llava-next-7b", "llava-next-tiny", "llava-onevision-7b",
    "llava-onevision-tiny", "llava-tiny", "qwen2-vl-7b", "qwen2-vl-tiny", "video-llava-7b", "video-llava-tiny",
]
PROFILES = sorted([*PROFILES, "qwen2.5-vl-7b", "qwen2.5-vl-tiny"])  # issue 25
PROFILES = sorted([*PROFILES, "qwen3-vl-8b", "qwen3-vl-tiny", "qwen3-vl-30b-a3b", "qwen3-vl-moe-tiny",  # issue 34
                   "qwen3.5-0.8b", "qwen3.5-tiny", "internvl3-8b", "internvl3-tiny"])


def raw_profile(name):
    with open(PROFILES_DIR / f"{name}.json") as f:
        return json.load(f)


@functools.cache
def hf_model_facts(name):
    """Build the profile's model on the meta device from its config: (parameters, config)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    data = raw_profile(name)
    data.pop("ficoco")
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters()), model.config


def test_every_profile_is_listed():
    assert list_profiles() == PROFILES


@pytest.mark.parametrize("name", PROFILES)
def test_parameter_counts_from_shapes_equal_hugging_face(name):
    hf_params, _ = hf_model_facts(name)
    arch = architecture(load_profile(name))
    assert parameter_counts(arch).total == hf_params
    assert weight_bytes(arch, "all", make_quant("fp16")) == 2 * hf_params


@pytest.mark.parametrize("name", PROFILES)
def test_decoder_shapes_equal_hugging_face_config(name):
    _, config = hf_model_facts(name)
    text = config.get_text_config()
    d = architecture(load_profile(name)).decoder
    assert d.layers == text.num_hidden_layers
    assert d.hidden == text.hidden_size
    assert d.heads == text.num_attention_heads
    assert d.kv_heads == (text.num_key_value_heads or text.num_attention_heads)
    assert d.ffn == text.intermediate_size
    assert d.vocab == text.vocab_size


@pytest.mark.parametrize("name", PROFILES)
def test_visual_tokens_per_image_equals_architecture(name):
    assert raw_profile(name)["ficoco"]["visual_tokens_per_image"] == architecture(load_profile(name)).visual_tokens


@pytest.mark.parametrize("name,field", [
    ("llava-1.5-7b", "image_seq_length"), ("llava-1.5-13b", "image_seq_length"), ("llava-tiny", "image_seq_length"),
    ("llava-gqa-tiny", "image_seq_length"), ("video-llava-7b", "video_seq_length"),
    ("video-llava-tiny", "video_seq_length"),
])
def test_visual_tokens_equal_the_configs_own_sequence_length(name, field):
    assert architecture(load_profile(name)).visual_tokens == raw_profile(name)[field]


def test_visual_token_layouts_by_hand():
    # LLaVA-NeXT 672x672: base 24x24 + 2x2 crops unpadded to 48x48 + 48 row newlines
    assert architecture(load_profile("llava-next-7b")).visual_tokens == 576 + 48 * 48 + 48
    # Qwen2-VL 672x672: 48x48 patches of 14, merged 2x2
    assert architecture(load_profile("qwen2-vl-7b")).visual_tokens == (672 // 14) ** 2 // 4
    # Video-LLaVA: 8 frames of 16x16 patches, each with its [CLS]
    assert architecture(load_profile("video-llava-7b")).visual_tokens == 8 * (16 * 16 + 1)


def test_load_profile_from_config_path_and_checkout_folder(tmp_path):
    data = raw_profile("llava-tiny")
    data.pop("ficoco")
    folder = tmp_path / "my-llava"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    by_folder = load_profile(str(folder))
    by_path = load_profile(str(folder / "config.json"))
    assert by_folder.name == by_path.name == "my-llava"
    assert by_folder.family == "llava" and by_folder.defaults["text_tokens"] == 60  # family defaults
    assert "ficoco" not in by_folder.hf_config_dict()
    shipped = architecture(load_profile("llava-tiny"))
    assert architecture(by_folder).decoder == shipped.decoder
    assert architecture(by_folder).visual_tokens == shipped.visual_tokens


def test_overrides_change_the_config_and_defaults():
    profile = load_profile("llava-1.5-7b", ["text_config.num_hidden_layers=4", "ficoco.text_tokens=5"])
    arch = architecture(profile)
    assert arch.decoder.layers == 4
    assert arch.text_tokens == 5
    assert profile.overrides == {"text_config.num_hidden_layers": 4, "ficoco.text_tokens": 5}
    assert architecture(load_profile("llava-1.5-7b")).decoder.layers == 32  # the shipped profile is untouched
    assert parse_overrides(["a.b=[1, 2]", "c=plain text", "d=true"]) == {"a.b": [1, 2], "c": "plain text", "d": True}


@pytest.mark.parametrize("item", ["foo", "=3", " =x"])
def test_override_without_key_value_is_refused(item):
    with pytest.raises(FicocoError, match="KEY=VALUE"):
        parse_overrides([item])


# Each --set is checked where it enters; the error names it (issue 18's fuzzer found each of these).
BAD_OVERRIDES = {
    "a NaN hidden by a later item": (["text_config.hidden_size=NaN", "text_config.hidden_size=64"], "finite"),
    "an infinite number in a list": (["ficoco.image_size=[1e400, 112]"], "finite"),
    "an empty key part": (["text_config..hidden_size=64"], "dotted config names"),
    "a section replaced by a number": (["text_config=4"], "text_config is a section"),
    "text where the config holds a count": (["text_config.hidden_size=abc"], "holds a whole number"),
    "the family": (["model_type=llava_next"], "chooses the model family"),
    "the ficoco section itself": (["ficoco=3"], "inside the ficoco section"),
    "zero layers": (["text_config.num_hidden_layers=0"], "from 1 to 1000"),
    "a million layers (hours of counting)": (["text_config.num_hidden_layers=1000000"], "from 1 to 1000"),
    "a width past 2**31 - 1": (["text_config.hidden_size=" + "9" * 40], "from 1 to 2147483647"),
    "text as head_dim (not in the config)": (['text_config.head_dim="abc"'], "head_dim"),
    "no patch fits the image": (["vision_config.image_size=3"], "smaller than patch_size"),
    "negative text tokens": (["ficoco.text_tokens=-5"], "ficoco.text_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_overrides_are_checked_where_they_enter(case):
    items, words = BAD_OVERRIDES[case]
    with pytest.raises(FicocoError, match="overrides=") as info:
        load_profile("llava-tiny", items)
    assert words in str(info.value)


def test_a_config_unreadable_before_the_overrides_is_not_blamed_on_them(tmp_path):
    config = json.loads((PROFILES_DIR / "llava-tiny.json").read_text())
    config["text_config"]["hidden_size"] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    profile = load_profile(str(path), ["text_config.vocab_size=100"])
    with pytest.raises(FicocoError, match="hidden_size=0") as info:
        architecture(profile)
    assert "overrides=" not in str(info.value)


def test_a_binary_config_is_a_user_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe")
    with pytest.raises(FicocoError, match="not a text file"):
        load_profile(str(path))


def test_load_profile_errors(tmp_path):
    with pytest.raises(FicocoError, match="unknown model='nosuch'"):
        load_profile("nosuch")
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{not json")
    with pytest.raises(FicocoError, match="not valid JSON"):
        load_profile(str(bad_json))
    other = tmp_path / "bert.json"
    other.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(FicocoError, match="not a supported family"):
        load_profile(str(other))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FicocoError, match="without a config.json"):
        load_profile(str(empty))


def test_profiles_are_not_shared_between_loads():
    first = load_profile("llava-tiny")
    snapshot = copy.deepcopy(first.config)
    first.config["text_config"]["hidden_size"] = 1
    assert load_profile("llava-tiny").config == snapshot


# docs/accounting.md's roofline table (bandwidth B/s, FP16 op/s, INT8 op/s); H200 from NVIDIA's datasheet.
HARDWARE = {
    "a100-40gb": (1555e9, 312e12, 624e12),
    "a100-80gb": (2039e9, 312e12, 624e12),
    "a800-80gb": (2039e9, 312e12, 624e12),
    "h100-sxm": (3072e9, 989.5e12, 1979e12),
    "h100-pcie": (2048e9, 756.5e12, 1513e12),
    "h200": (4.8e12, 989.5e12, 1979e12),
}


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_profiles_match_the_accounting_table(name):
    gpu = load_gpu(name)
    assert (gpu.bandwidth_bytes_per_s, gpu.fp16_ops_per_s, gpu.int8_ops_per_s) == HARDWARE[name]


def test_gpu_names_are_normalised_and_unknown_ones_refused():
    assert sorted(list_gpus()) == sorted(HARDWARE)
    assert load_gpu("A100_80GB") == load_gpu("a100-80gb")
    with pytest.raises(FicocoError, match="unknown GPU 'b200'"):
        load_gpu("b200")


# ---- a geometry the family's transformers classes refuse is refused by its shape module, in one line ------------

# (profile, --set KEY=VALUE, what the one line says)
REFUSED_GEOMETRY = {
    "llava text heads": ("llava-1.5-7b", "text_config.hidden_size=4097",
                         "text_config.hidden_size=4097 is not divisible by text_config.num_attention_heads=32"),
    "llava vision heads": ("llava-1.5-7b", "vision_config.hidden_size=1025",
                           "vision_config.hidden_size=1025 is not divisible by vision_config.num_attention_heads=16"),
    "llava-next text heads": ("llava-next-7b", "text_config.hidden_size=4097",
                              "text_config.hidden_size=4097 is not divisible by text_config.num_attention_heads=32"),
    "video-llava vision heads": ("video-llava-7b", "vision_config.hidden_size=1025",
                                 "vision_config.hidden_size=1025 is not divisible by "
                                 "vision_config.num_attention_heads=16"),
    "onevision siglip heads": ("llava-onevision-7b", "vision_config.hidden_size=1153",
                               "vision_config.hidden_size=1153 is not divisible by "
                               "vision_config.num_attention_heads=16"),
    "qwen2-vl text heads": ("qwen2-vl-7b", "text_config.hidden_size=3585",
                            "text_config.hidden_size=3585 is not divisible by text_config.num_attention_heads=28"),
    "qwen2-vl tower heads": ("qwen2-vl-7b", "vision_config.embed_dim=1281",
                             "vision_config.embed_dim=1281 is not divisible by vision_config.num_heads=16"),
    "qwen2.5-vl text heads": ("qwen2.5-vl-7b", "text_config.hidden_size=3585",
                              "text_config.hidden_size=3585 is not divisible by text_config.num_attention_heads=28"),
    "qwen2.5-vl tower heads": ("qwen2.5-vl-7b", "vision_config.hidden_size=1281",
                               "vision_config.hidden_size=1281 is not divisible by vision_config.num_heads=16"),
    "kv heads": ("qwen2-vl-7b", "text_config.num_key_value_heads=5",
                 "num_attention_heads=28 is not a multiple of num_key_value_heads=5"),
}


@pytest.mark.parametrize("case", REFUSED_GEOMETRY.values(), ids=list(REFUSED_GEOMETRY))
def test_flops_refuses_a_geometry_transformers_refuses_in_one_line(case):
    from helpers import assert_one_error_line, run_cli

    name, override, says = case
    line = assert_one_error_line(run_cli("flops", "--model", name, "--set", override))
    assert says in line and override.partition("=")[0] in line


def test_profile_refuses_the_impossible_llava_before_building_it():
    """The issue's case: `ficoco profile` with the override ended in transformers' cut-off
    StrictDataclassClassValidationError; now the same one line as `ficoco flops`, exit 2."""
    from helpers import assert_one_error_line, run_cli

    line = assert_one_error_line(run_cli("profile", "--model", "llava-1.5-7b", "--set",
                                         "text_config.hidden_size=4097", "--variant", "vanilla"))
    assert "text_config.hidden_size=4097 is not divisible by text_config.num_attention_heads=32" in line
    assert "StrictDataclass" not in line


def test_a_geometry_transformers_takes_is_counted():
    """LLaVA-OneVision's Qwen2 attention takes a hidden size that is not a multiple of the heads
    (head_dim = hidden // heads): the shape module counts it rather than refuse it."""
    profile = load_profile("llava-onevision-7b", ["text_config.hidden_size=3585"])
    assert architecture(profile).decoder.head_dim == 3585 // 28


def test_the_family_table_gives_the_profile_defaults_and_the_layout_options():
    from ficoco.accounting.families import FAMILIES
    from ficoco.profiles import FAMILY_DEFAULTS, set_layout

    assert list(FAMILY_DEFAULTS) == list(FAMILIES)
    assert all(defaults["family"] == name for name, defaults in FAMILY_DEFAULTS.items())
    with pytest.raises(FicocoError, match=r"^image_size= applies to llava_next, qwen2_vl, qwen2_5_vl, "
                                          r"llava_onevision, qwen3_vl, qwen3_vl_moe, qwen3_5 and internvl models, "
                                          r"not llava$"):
        set_layout(load_profile("llava-tiny"), image_size=(336, 336))
    with pytest.raises(FicocoError, match="not both"):
        set_layout(load_profile("llava-onevision-tiny"), image_size=(384, 384), frames=4)
    qwen = load_profile("qwen2-vl-tiny")
    set_layout(qwen, image_size=(224, 224), frames=4)  # a video of frames of that size
    assert qwen.defaults["image_size"] == [224, 224] and qwen.defaults["frames"] == 4


def test_every_family_the_accountant_knows_has_an_adapter_with_the_same_prompt_prefix():
    """The accountant's text after the visual span (text tokens - prefix) is what the adapters' synthetic
    inputs put there: one prefix count per family, in its shape module and its adapter alike."""
    from ficoco.accounting.families import FAMILIES as SHAPES
    from ficoco.models import FAMILIES as ADAPTERS
    from ficoco.models import family_module

    assert set(SHAPES) == set(ADAPTERS)
    for name, family in SHAPES.items():
        assert family.prefix_tokens == family_module(name).PREFIX_TOKENS, name


def test_every_family_module_says_how_its_prompts_are_laid_out_and_the_prompt_module_names_none():
    import ast
    from pathlib import Path

    from ficoco.models import FAMILIES, family_module
    from ficoco.models.prompt import PromptFormat

    for name in FAMILIES:
        form = family_module(name).PROMPT
        assert isinstance(form, PromptFormat) and form.media and set(form.media) <= {"image", "video"}, name
        assert "{question}" in form.template, name
    source = Path(__file__).resolve().parents[1] / "ficoco" / "models" / "prompt.py"
    strings = {node.value for node in ast.walk(ast.parse(source.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & set(FAMILIES), "a family's prompt rule belongs in its module's PROMPT"
