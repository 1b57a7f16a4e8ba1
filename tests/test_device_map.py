"""Models split across devices through accelerate (issue 26, item 4): a tiny model under a CPU limit
smaller than itself runs with layers offloaded to disk and gives the unsplit model's logits, kept
tokens and generated tokens, for vanilla and the methods; the patches wrap accelerate's hooked
forward and give it back exactly; profile --device-map reports memory per device; the guard's advice
names offload. On the CPU; the GPU split is a `gpu` test."""

from __future__ import annotations

import json
import tempfile
from typing import Any

import pytest
import torch
from accelerate import dispatch_model
from torch import nn

import ficoco
from ficoco.accounting.memory import memory_per_device
from ficoco.errors import FicocoError
from ficoco.machine.dtype_choice import DtypeChoice
from ficoco.machine.memory_guard import VanillaRow, check_memory
from ficoco.models import synthetic_inputs
from ficoco.models.device_map import parse_max_memory
from ficoco.profiles import load_profile

CPU_LIMIT = "900KiB"  # llava-tiny in float32 holds about 2 MB of weights
# One setting per method, each reducing something on llava-tiny (6 vision layers, 4 decoder layers).
METHODS: dict[str, dict[str, Any]] = {
    "v": {"keep": 16}, "l": {"keep": 16}, "fastv": {}, "tome": {}, "visionzip": {"keep": 16}, "pdrop": {"keep": 24},
}


@pytest.fixture(scope="module")
def reference() -> nn.Module:
    return ficoco.build_model("llava-tiny", dtype="fp32")


@pytest.fixture(scope="module")
def offloaded() -> nn.Module:
    return ficoco.build_model("llava-tiny", dtype="fp32", device_map="cpu-offload", max_memory=f"cpu={CPU_LIMIT}")


@pytest.fixture(scope="module")
def decoder_split() -> nn.Module:
    """A map the user gave accelerate, splitting the decoder itself: layers 0-1 in memory, 2-3 on disk."""
    model = ficoco.build_model("llava-tiny", dtype="fp32")
    device_map = {"model.vision_tower": "cpu", "model.multi_modal_projector": "disk",
                  "model.language_model.embed_tokens": "cpu", "model.language_model.layers.0": "cpu",
                  "model.language_model.layers.1": "cpu", "model.language_model.layers.2": "disk",
                  "model.language_model.layers.3": "disk", "model.language_model.norm": "disk",
                  "model.language_model.rotary_emb": "cpu", "lm_head": "disk"}
    folder = tempfile.mkdtemp(prefix="ficoco-test-offload-")
    return dispatch_model(model, device_map, main_device="cpu", offload_dir=folder,
                          preload_module_classes=sorted(model._no_split_modules))


def run(model: nn.Module, variant: str | None, inputs: dict[str, Any]) -> tuple[Any, Any, list]:
    handle = ficoco.apply(model, variant, **METHODS[variant]) if variant else None
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
            records = [(r.stage, r.layer, r.kept.tolist()) for r in handle.records] if handle else []
            tokens = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        if handle is not None:
            handle.remove()
    return logits, tokens, records


def test_the_map_offloads_past_the_cpu_limit(offloaded: nn.Module) -> None:
    summary = offloaded._ficoco_device_map
    assert set(offloaded.hf_device_map.values()) == {"cpu", "disk"}
    assert summary["policy"] == "cpu-offload" and summary["main_device"] == "cpu"
    assert 0 < summary["weight_bytes_per_device"]["cpu"] <= parse_max_memory(f"cpu={CPU_LIMIT}")["cpu"]
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # offloaded weights: not in memory


def test_a_model_wholly_on_disk_takes_its_inputs_on_the_computing_device(reference: nn.Module) -> None:
    on_disk = ficoco.build_model("llava-tiny", dtype="fp32", device_map="cpu-offload", max_memory="cpu=1KiB")
    assert set(on_disk.hf_device_map.values()) == {"disk"} and next(on_disk.parameters()).device.type == "meta"
    inputs = synthetic_inputs(on_disk, batch=1, text_tokens=8, seed=4)  # placed on the CPU, not on meta
    assert {value.device.type for value in inputs.values()} == {"cpu"}
    with torch.no_grad():
        assert torch.equal(on_disk(**inputs).logits, reference(**inputs).logits)


@pytest.mark.parametrize("variant", [None, *METHODS])
def test_offloaded_model_gives_the_unsplit_logits_kept_tokens_and_generation(
        reference: nn.Module, offloaded: nn.Module, variant: str | None) -> None:
    inputs = synthetic_inputs(reference, batch=2, text_tokens=8, seed=1)
    logits, tokens, records = run(reference, variant, inputs)
    split_logits, split_tokens, split_records = run(offloaded, variant, inputs)
    assert torch.equal(logits, split_logits)
    assert torch.equal(tokens, split_tokens)
    assert records == split_records
    if variant not in (None, "visionzip"):
        assert records  # the method reduced something: the comparison is not vacuous


@pytest.mark.parametrize("variant", ["l", "fastv", "pdrop"])
def test_a_decoder_split_by_the_user_gives_the_unsplit_results(reference: nn.Module, decoder_split: nn.Module,
                                                                variant: str) -> None:
    inputs = synthetic_inputs(reference, batch=1, text_tokens=8, seed=2)
    logits, tokens, records = run(reference, variant, inputs)
    split_logits, split_tokens, split_records = run(decoder_split, variant, inputs)
    assert torch.equal(logits, split_logits) and torch.equal(tokens, split_tokens) and records == split_records


@pytest.mark.parametrize("family,keep", [("qwen2-vl-tiny", 4), ("llava-next-tiny", 28)])
def test_other_families_offloaded_give_the_unsplit_results(family: str, keep: int) -> None:
    """Qwen2-VL's own tower, merger and entry patches, LLaVA-NeXT's crops, with the vision tower split
    between CPU memory and disk and the decoder on disk."""
    whole = ficoco.build_model(family, dtype="fp32")
    split = ficoco.build_model(family, dtype="fp32", device_map="cpu-offload", max_memory={"cpu": 700_000})
    assert {"cpu", "disk"} <= set(split.hf_device_map.values())
    inputs = synthetic_inputs(whole, batch=1, text_tokens=16, seed=1)
    for variant in ("v", "l"):
        results = []
        for model in (whole, split):
            handle = ficoco.apply(model, variant, keep=keep)
            try:
                with torch.no_grad():
                    results.append((model(**inputs).logits, [r.kept.tolist() for r in handle.records]))
            finally:
                handle.remove()
        (logits, kept), (split_logits, split_kept) = results
        assert kept and kept == split_kept and torch.equal(logits, split_logits)


def test_a_checkpoint_loads_into_the_map_and_gives_the_unsplit_results(reference: nn.Module, tmp_path) -> None:
    """from_pretrained places the checkpoint itself (its hooks load each linear's weights when it is
    called, not a whole layer's): PDrop's own query-key projections still see their weights."""
    reference.save_pretrained(tmp_path)
    split = ficoco.build_model("llava-tiny", str(tmp_path), dtype="fp32", device_map="auto",
                               max_memory=f"cpu={CPU_LIMIT}")
    assert {"cpu", "disk"} <= set(split.hf_device_map.values()) and split._ficoco_device_map["policy"] == "auto"
    inputs = synthetic_inputs(reference, batch=1, text_tokens=8, seed=5)
    for variant in ("l", "pdrop"):
        logits, tokens, records = run(reference, variant, inputs)
        split_logits, split_tokens, split_records = run(split, variant, inputs)
        assert torch.equal(logits, split_logits) and torch.equal(tokens, split_tokens) and records == split_records


def test_patches_wrap_the_hooked_forward_and_undo_restores_accelerates_hooks(decoder_split: nn.Module) -> None:
    hooked = {name: module for name, module in decoder_split.named_modules() if "_hf_hook" in module.__dict__}
    layer = decoder_split.model.language_model.layers[2]
    assert "model.language_model.layers.2" in hooked
    before = {name: (m.__dict__["forward"], m.__dict__["_old_forward"], m._hf_hook) for name, m in hooked.items()}
    handle = ficoco.apply(decoder_split, "l", keep=16)
    # accelerate's wrapper stays the module's forward (its hook runs first); the patch is what it wraps
    assert layer.__dict__["forward"] is before["model.language_model.layers.2"][0]
    assert layer.__dict__["_old_forward"] is not before["model.language_model.layers.2"][1]
    handle.remove()
    after = {name: (m.__dict__["forward"], m.__dict__["_old_forward"], m._hf_hook) for name, m in hooked.items()}
    assert all(after[name][k] is before[name][k] for name in before for k in range(3))


def test_memory_per_device_puts_each_layers_cache_where_it_computes() -> None:
    table = memory_per_device({"cuda:0": 10.0, "cpu": 30.0, "disk": 5.0}, [1.0, 2.0, 4.0],
                              ["cuda:0", "cuda:1", "cuda:1"])
    assert table["cuda:0"] == {"weights_bytes": 10.0, "kv_cache_bytes": 1.0}
    assert table["cuda:1"] == {"weights_bytes": 0.0, "kv_cache_bytes": 6.0}
    assert table["disk"]["kv_cache_bytes"] == 0.0
    with pytest.raises(ValueError):
        memory_per_device({}, [1.0], [])


def test_max_memory_parses_devices_and_units() -> None:
    assert parse_max_memory("cpu=200MiB,cuda:0=1.5GB, 1=2KiB") == {"cpu": 200 * 2**20, 0: 1_500_000_000, 1: 2048}
    assert parse_max_memory(None) is None
    for bad in ("cpu", "cpu=lots", "tpu=1GB", "cpu=-1GB"):
        with pytest.raises(FicocoError):
            parse_max_memory(bad)


TINY = ["profile", "--model", "llava-tiny", "--variant", "l", "--keep", "16", "--dtype", "fp32", "--repeat", "1",
        "--warmup", "0"]


def test_profile_with_cpu_offload_reports_memory_per_device(tmp_path, cli) -> None:
    path = tmp_path / "split.json"
    result = cli(*TINY, "--device-map", "cpu-offload", "--max-memory", f"cpu={CPU_LIMIT}", "--json", str(path))
    assert result.code == 0, result.err
    rows = json.loads(path.read_text())["rows"]
    assert [row["status"] for row in rows] == ["ok", "ok"]
    for row in rows:
        devices = row["memory_per_device"]
        assert set(devices) == {"cpu", "disk"} and row["device_map"]["policy"] == "cpu-offload"
        # The decoder computes on the CPU: its cache is there, as the accountant says, and nothing on disk.
        assert devices["cpu"]["kv_cache_bytes"] == devices["cpu"]["kv_cache_measured_bytes"] == row["kv_cache_bytes"]
        assert devices["disk"]["kv_cache_bytes"] == 0 and devices["disk"]["weights_bytes"] > 0
        assert devices["cpu"]["peak_bytes"] > 0
    assert rows[1]["kv_cache_bytes"] < rows[0]["kv_cache_bytes"]


@pytest.mark.parametrize("args,message", [
    (["--device-map", "everywhere"], "unknown --device-map 'everywhere': choose from auto, balanced, cpu-offload"),
    (["--device-map", "auto", "--max-memory", "cpu=lots"], "memory size 'lots' is not a size"),
    (["--max-memory", "cpu=1GiB"], "--max-memory sets the limits of a device map; give --device-map too"),
    (["--device-map", "auto", "--max-memory", "cuda:3=1GiB"], "--max-memory names cuda:3, but torch sees 0 GPU(s)"),
])
def test_a_device_map_mistake_ends_in_one_line_and_exit_2(args: list[str], message: str, cli) -> None:
    result = cli(*TINY, *args)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0] == f"error: {message}" or message in lines[0], lines
    assert len(lines) == 1


@pytest.mark.parametrize("device,offer", [("cpu", "device_map=cpu-offload max_memory=cpu="),
                                          ("cuda", "device_map=cpu-offload (weights 14.1 GB in CPU memory")])
def test_the_guard_offers_offload_when_the_weights_do_not_fit(device: str, offer: str, monkeypatch) -> None:
    monkeypatch.setenv("FICOCO_TEST_FREE_MEMORY_BYTES", "64e9")  # the host's memory, for the GPU's advice
    profile = load_profile("llava-1.5-7b")
    half = DtypeChoice(torch.float16, torch.float16, "")
    with pytest.raises(FicocoError) as error:
        check_memory(profile, [VanillaRow()], half, ["fp16"], device, free_bytes=4e9, free_source="test")
    assert offer in str(error.value)
    with pytest.raises(FicocoError) as error:  # not even one layer and the activations fit: no offer
        check_memory(profile, [VanillaRow()], half, ["fp16"], device, free_bytes=0.3e9, free_source="test")
    assert "device_map=" not in str(error.value)
    if device == "cuda":  # a host without room for the weights: the rest on disk
        monkeypatch.setenv("FICOCO_TEST_FREE_MEMORY_BYTES", "8e9")
        with pytest.raises(FicocoError) as error:
            check_memory(profile, [VanillaRow()], half, ["fp16"], device, free_bytes=4e9, free_source="test")
        assert "device_map=cpu-offload max_memory=cpu=7152MiB (weights past it on disk" in str(error.value)


@pytest.mark.gpu
def test_a_gpu_split_gives_the_unsplit_tokens() -> None:
    """Part of the model on each GPU (or, with one GPU, part on the GPU and part in CPU memory), against
    the model on one GPU: the same generated tokens and kept tokens for vanilla and the methods."""
    whole = ficoco.build_model("llava-tiny", dtype="fp32", device="cuda")
    gpus = torch.cuda.device_count()
    limits = {index: "1200KiB" for index in range(gpus)} | {"cpu": "1GiB"}  # llava-tiny: about 2 MB in fp32
    split = ficoco.build_model("llava-tiny", dtype="fp32", device_map="balanced" if gpus > 1 else "auto",
                               max_memory=limits)
    devices = set(split.hf_device_map.values())
    assert len(devices) > 1
    inputs = synthetic_inputs(whole, batch=2, text_tokens=8, seed=3, device="cuda")
    for variant in (None, "v", "l", "fastv", "tome"):
        logits, tokens, records = run(whole, variant, inputs)
        split_logits, split_tokens, split_records = run(split, variant, inputs)
        assert torch.allclose(logits, split_logits.to(logits.device), atol=1e-4)
        assert torch.equal(tokens, split_tokens.to(tokens.device)) and records == split_records
