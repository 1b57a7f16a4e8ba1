"""The contract with transformers' internals (ficoco.models.hf_compat), checked against the installed
release before any behavioural test runs (conftest.py puts this file first).

A failure here is one line naming the contact that changed (a renamed argument, a moved attribute, a
function with another signature): fix hf_compat.py for the new release, or keep transformers inside
pyproject.toml's tested range.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest
import torch
from torch import nn

import ficoco
from ficoco import versions
from ficoco.errors import FicocoError
from ficoco.models import hf_compat as hf
from ficoco.models import synthetic_inputs

TINY_FAMILIES = ("llava-tiny", "llava-next-tiny", "video-llava-tiny", "qwen2-vl-tiny", "llava-onevision-tiny")
TINY_FAMILIES += ("qwen2.5-vl-tiny",)
TINY_FAMILIES += ("qwen3-vl-tiny", "qwen3-vl-moe-tiny")
TINY_FAMILIES += ("internvl3-tiny",)


@pytest.mark.parametrize("name", sorted(hf.CONTACTS))
def test_contact_holds_on_the_installed_release(name: str) -> None:
    try:
        hf.CONTACTS[name].check()
    except hf.ContactChanged as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tiny(request: pytest.FixtureRequest) -> nn.Module:
    try:
        return ficoco.build_model(request.param, dtype="fp32")
    except FicocoError as exc:  # a release outside the range whose contacts changed: named above
        pytest.skip(str(exc))


def test_every_attribute_path_resolves_in_every_family(tiny: nn.Module) -> None:
    try:
        hf.check_model(tiny)
    except hf.ContactChanged as exc:
        pytest.fail(str(exc), pytrace=False)


def _record_calls(modules: dict[str, nn.Module]) -> tuple[dict[str, tuple[tuple, dict]], list[Any]]:
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for label, module in modules.items():
        def hook(_module: nn.Module, args: tuple, kwargs: dict, label: str = label) -> None:
            seen.setdefault(label, (args, dict(kwargs)))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def test_layers_are_called_as_the_patches_take_their_arguments(tiny: nn.Module) -> None:
    """The wrapped layers bind by keyword what the model passes by keyword: a decoder layer gets
    hidden_states alone by position and the mask, positions, rotary tables and cache (under the
    release's own name) by keyword; a tower layer gets hidden_states first."""
    decoder = hf.decoder_layers(tiny)[0]
    modules = {"decoder layer": decoder, "decoder attention": hf.layer_parts(decoder, hf.DECODER_LAYER).attention}
    if tiny.config.model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        modules["vision block"] = hf.qwen2_vl_blocks(hf.qwen2_vl_tower(tiny))[0]
    elif tiny.config.model_type == "internvl":  # InternViT: its layers are called with hidden_states alone
        modules["tower layer"] = hf.internvl_layers(hf.clip_tower(tiny, "vision_tower"))[0]
    else:
        tower = "video_tower" if tiny.config.model_type == "video_llava" else "vision_tower"
        modules["tower layer"] = hf.clip_layers(hf.clip_tower(tiny, tower))[0]
    seen, handles = _record_calls(modules)
    try:
        with torch.no_grad():
            tiny(**synthetic_inputs(tiny), use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    args, kwargs = seen["decoder layer"]
    assert len(args) == 1, f"decoder layers now get {len(args)} positional inputs (the patches take one)"
    for keyword in (*hf.DECODER_LAYER_KEYWORDS, hf.cache_keyword()):
        assert keyword in kwargs, f"decoder layers are no longer given {keyword} by keyword"
    _, kwargs = seen["decoder attention"]
    assert {"hidden_states", "attention_mask", "position_embeddings", hf.cache_keyword()} <= set(kwargs)
    if "vision block" in seen:
        args, kwargs = seen["vision block"]
        assert len(args) == 1 and set(hf.QWEN2_VL_BLOCK_KEYWORDS) <= set(kwargs)
    else:
        args, _ = seen["tower layer"]
        assert len(args) >= 1 and args[0].dim() == 3


def test_the_output_holds_the_cache_under_the_releases_field(tiny: nn.Module) -> None:
    with torch.no_grad():
        out = tiny(**synthetic_inputs(tiny), use_cache=True)
    cache = hf.output_cache(out)
    assert cache is not None and cache.get_seq_length() > 0
    assert hf.cache_layer_tokens(hf.cache_layers(cache)[0]) == cache.get_seq_length()


def test_cache_in_reads_either_name() -> None:
    marker = object()
    assert hf.cache_in({"cache": marker}) is marker
    assert hf.cache_in({"past_key_values": marker}) is marker
    assert hf.cache_in({"input_ids": 1}) is None
    assert list(hf.cache_argument(marker)) == [hf.cache_keyword()]


# -- a changed contact is named in one line --------------------------------------------------


def _without_position_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaMA's decoder layer as a release that no longer takes position_ids would have it."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaDecoderLayer.forward
    signature = inspect.signature(real)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs)

    forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != "position_ids"])
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)


def test_a_removed_parameter_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_position_ids(monkeypatch)
    problems = hf.check_contacts()
    named = [line for line in problems if "decoder layer call" in line]
    assert len(named) == 1 and "position_ids" in named[0] and "pip install 'transformers" in named[0]
    assert all("\n" not in line for line in problems)


def test_a_missing_attribute_is_named_in_one_line(tiny: nn.Module) -> None:
    layer = hf.decoder_layers(tiny)[0]
    moved = layer._modules.pop("self_attn")
    try:
        with pytest.raises(hf.ContactChanged, match=r"has no 'self_attn'") as raised:
            hf.check_model(tiny)
        assert "\n" not in str(raised.value)
    finally:
        layer._modules["self_attn"] = moved


def test_an_untested_release_warns_once_then_names_what_changed(
        tiny: nn.Module, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a release outside the tested range apply() prints one warning line and checks the contacts
    before patching: a changed one ends in a FicocoError naming it, not in a crash inside a forward."""
    monkeypatch.setattr(versions, "installed_version", lambda name: "99.0.0" if name == "transformers" else None)
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(hf, "_contacts_checked", None)
    _without_position_ids(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="ficoco"):
        with pytest.raises(FicocoError, match="decoder layer call"):
            ficoco.apply(tiny, "l", schedule={})
        with pytest.raises(FicocoError, match="decoder layer call"):
            ficoco.apply(tiny, "l", schedule={})
    warnings = [r.getMessage() for r in caplog.records if r.name == "ficoco"]
    assert len(warnings) == 1 and "transformers 99.0.0 is outside the tested range" in warnings[0]
    assert "\n" not in warnings[0]
    assert "_ficoco_handle" not in tiny.__dict__  # nothing was patched


def test_an_untested_release_whose_contacts_hold_patches_after_one_warning(
        tiny: nn.Module, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda name: "99.0.0" if name == "transformers" else None)
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(hf, "_contacts_checked", None)
    with caplog.at_level(logging.WARNING, logger="ficoco"):
        handle = ficoco.apply(tiny, "l", schedule={})
    handle.remove()
    assert [r.getMessage() for r in caplog.records if r.name == "ficoco"][0].startswith("ficoco: transformers 99.0.0")


# ---- the shape modules refuse what transformers' classes refuse, and count what they take ----------------------

# (tiny profile, config key, value): a hidden size (tiny: 64 over 4 heads) that is not a multiple of the heads.
GEOMETRIES = {
    "llava text": ("llava-tiny", "text_config.hidden_size", 66, False),  # LlamaConfig's validator
    "llava-next vision": ("llava-next-tiny", "vision_config.hidden_size", 66, False),  # CLIPVisionConfig's
    "video-llava vision": ("video-llava-tiny", "vision_config.hidden_size", 66, False),
    "onevision vision": ("llava-onevision-tiny", "vision_config.hidden_size", 66, False),  # SiglipAttention
    "onevision text": ("llava-onevision-tiny", "text_config.hidden_size", 66, True),  # Qwen2 takes it
    "qwen2-vl text": ("qwen2-vl-tiny", "text_config.hidden_size", 66, False),  # Qwen2VLAttention
    "qwen2-vl tower": ("qwen2-vl-tiny", "vision_config.embed_dim", 66, False),  # its reshape, at the forward
    "qwen2.5-vl tower": ("qwen2.5-vl-tiny", "vision_config.hidden_size", 66, False),
}


def _set(profile: Any, key: str, value: Any) -> None:
    """Set a config key past the override checks (as a config.json of that geometry would hold it)."""
    section, _, name = key.rpartition(".")
    (profile.config[section] if section else profile.config)[name] = value


def _transformers_runs(profile: Any) -> bool:
    """Whether transformers builds the profile's model and runs a forward on it (random weights)."""
    try:
        model = ficoco.build_model(profile, dtype="fp32", check_memory=False)
        with torch.no_grad():
            model(**synthetic_inputs(model))
    except Exception:  # noqa: BLE001 - a refusal of any kind, at the config, the build or the forward
        return False
    return True


@pytest.mark.parametrize("case", GEOMETRIES.values(), ids=list(GEOMETRIES))
def test_the_shape_module_refuses_what_transformers_refuses(case: tuple[str, str, int, bool]) -> None:
    from ficoco.accounting import architecture
    from ficoco.profiles import load_profile

    name, key, value, taken = case
    profile = load_profile(name)
    _set(profile, key, value)
    assert _transformers_runs(profile) == taken
    if taken:
        architecture(profile)
    else:
        with pytest.raises(FicocoError, match=rf"{key}={value} is not divisible by "):
            architecture(profile)


def test_the_build_turns_a_config_refusal_into_one_line() -> None:
    """A config transformers' validators refuse (past the accountant: no memory check) ends in one
    FicocoError line, not the strict dataclass's message of several lines cut off."""
    from ficoco.profiles import load_profile

    profile = load_profile("llava-tiny")
    _set(profile, "text_config.hidden_size", 66)
    with pytest.raises(FicocoError) as caught:
        ficoco.build_model(profile, dtype="fp32", check_memory=False)
    message = str(caught.value)
    assert "\n" not in message and "validate_architecture" not in message
    assert message.startswith("transformers refuses the config of llava-tiny: The hidden size (66) is not a "
                              "multiple of the number of attention heads (4)")
