"""No host synchronisation per reducing layer.

On a GPU every `bool()`/`int()`/`.item()`/`.cpu()` of a device tensor inside the timed prefill
stalls the launch queue; before this was fixed a V prefill of LLaVA-1.5-7B made ~44 of them
and an L prefill ~280, vanilla none. They are counted here on the CPU (see
ficoco.profiling.host_sync): a patched forward may ask the device a constant number of
questions per call (where its spans are), never one per reducing layer, and decode steps
none at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ficoco
from ficoco.models import synthetic_inputs
from ficoco.models.stage_timer import StageTimer
from ficoco.profiling.host_sync import count_host_syncs

# (profile, variant, schedule with few reducing layers, schedule with more, the most syncs a
# prefill may add to vanilla's). LLaVA-NeXT's entry also reads image_sizes (one copy to the
# host, then reads of that host copy, which the counter cannot tell from device reads) and
# its protected-token count.
CASES = [
    ("llava-tiny", "v", "2:8", "1:4,2:4,3:4,4:4", 1),
    ("llava-tiny", "l", "1:8", "1:4,2:4,3:4", 1),
    ("llava-next-tiny", "l", "1:8", "1:4,2:4,3:4", 5),
    ("qwen2-vl-tiny", "l", "1:8", "1:4,2:4,3:4", 1),
]


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {name: ficoco.build_model(name, dtype="fp32") for name in {case[0] for case in CASES}}


def syncs(fn) -> int:
    with torch.no_grad(), count_host_syncs() as counts:
        fn()
    return sum(counts.values())


@pytest.mark.parametrize(("name", "variant", "few", "more", "entry_syncs"), CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_prefill_and_decode_make_no_host_sync_per_reducing_layer(models, name, variant, few, more,
                                                                  entry_syncs) -> None:
    model = models[name]
    inputs = synthetic_inputs(model, batch=2, text_tokens=12, seed=3)
    vanilla_prefill = syncs(lambda: model(**inputs))
    vanilla_generate = syncs(lambda: model.generate(**inputs, max_new_tokens=4, do_sample=False))
    counts = {}
    for schedule in (few, more):
        with ficoco.apply(model, variant, schedule=schedule):
            counts[schedule] = (syncs(lambda: model(**inputs)),
                                syncs(lambda: model.generate(**inputs, max_new_tokens=4, do_sample=False)))
    assert counts[few] == counts[more], f"syncs grow with the reducing layers: {counts}"
    prefill, generate = counts[more]
    assert prefill - vanilla_prefill <= entry_syncs, f"prefill: {prefill} syncs, vanilla {vanilla_prefill}"
    # Decode steps add nothing: what generate adds is the prefill's (and V's span shortening).
    assert generate - vanilla_generate <= entry_syncs + 1, f"generate: {generate} syncs, vanilla {vanilla_generate}"


def test_records_stay_on_the_device_until_read(models) -> None:
    model = models["llava-tiny"]
    inputs = synthetic_inputs(model, batch=1, text_tokens=12, seed=3)
    with ficoco.apply(model, "l", schedule="1:4,2:4") as handle:
        with torch.no_grad(), count_host_syncs() as counts:
            model(**inputs)
        assert counts["Tensor.cpu"] == 0
        assert len(handle._pending) == 2
        assert [r.layer for r in handle.records] == [1, 2] and not handle._pending
        assert all(r.kept.device.type == "cpu" for r in handle.records)


class FakeEvent:
    """A CUDA event that records when it was recorded, in fake milliseconds."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.waited = False

    def record(self) -> None:
        FakeEvent.clock += 1.5
        self.at = FakeEvent.clock

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def test_stage_timer_on_cuda_records_events_and_never_synchronises_inside_spans(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("synchronised inside the timed forward")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    timer = StageTimer()
    cuda = torch.device("cuda")
    for _ in range(3):
        with timer.span("reduction", cuda):
            FakeEvent.clock += 10.0  # the stage's kernels
    with timer.span("probe", cuda):
        FakeEvent.clock += 2.0
    # Read after the caller's own synchronise: each span is 10 ms + 1.5 ms of recording.
    assert timer.total_ms("reduction") == pytest.approx(3 * 11.5)
    assert timer.total_ms("probe") == pytest.approx(3.5)
    assert timer.total_ms() == pytest.approx(3 * 11.5 + 3.5)
    timer.reset()
    assert timer.total_ms() == 0.0


def test_reduction_and_probe_time_are_on_the_handle(models) -> None:
    model = models["llava-tiny"]
    inputs = synthetic_inputs(model, batch=1, text_tokens=12, seed=3)
    with ficoco.apply(model, "v", schedule="2:8,3:8") as handle:
        with torch.no_grad():
            model(**inputs)
        assert handle.timer.total_ms("reduction") > 0
        assert handle.timer.total_ms("probe") > 0
        assert handle.reduction_seconds == pytest.approx(handle.timer.total_ms("reduction") / 1e3)
