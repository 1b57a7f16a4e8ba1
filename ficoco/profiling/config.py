"""What defines a profile run (`ProfileConfig`), and the parsing of its options that are lists of
numbers. No torch here: a config is made, and written into a report, before any model is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ficoco.accounting.request import ScheduleRequest
from ficoco.errors import FicocoError


@dataclass(frozen=True)
class ProfileConfig:
    """Everything that defines a profile run (`ficoco.profile(config)`; written into the report
    beside its rows, `to_json`).

    The schedule fields (`keep`, `tflops`, `schedule`, `shape`, `first_layer`) are the keyword
    spelling of one `ScheduleRequest`, checked once when the config is made and handed whole to
    the planner (`request`); `with_request` makes a config from a request. A `preset` N is folded
    into `keep` N here (a profile's rows are labelled by the visual tokens that stay) and kept only
    to name it in an error; the report holds it as `keep`.
    """

    model: str
    variants: tuple[str, ...] = ("vanilla", "v")
    keep: int | None = None
    tflops: float | None = None
    schedule: str | None = None
    shape: str | None = None
    first_layer: int | None = None
    convention: str = "flops"
    scope: str = "llm"
    equivalent: bool = False
    quants: tuple[str, ...] = ("fp16",)
    batches: tuple[int, ...] = (1,)
    text_tokens: int = 60
    new_tokens: int = 0
    warmup: int | None = None  # None: chosen per row by the time rule (profiling/runs.py)
    repeat: int | None = None
    device: str = "auto"
    weights: str = "random"
    image: str | None = None
    prompt: str | None = None
    overrides: tuple[str, ...] = ()
    seed: int = 0
    kv_bits: int | None = None
    image_size: tuple[int, int] | None = None  # (H, W)
    frames: int | None = None
    dtype: str = "auto"  # auto, bf16, fp16, fp32 (dtype_choice.choose_dtype)
    video: str | None = None  # a video file or a folder of frames (Video-LLaVA)
    fidelity: bool = False  # reduced rows against vanilla on the same inputs (profiling/fidelity.py)
    device_map: str | None = None  # auto, balanced, cpu-offload: split through accelerate (models/device_map.py)
    max_memory: str | None = None  # per-device limits of the device map: "cpu=200MiB,cuda:0=20GiB"
    # Decoder layers with weights of their own; the deeper ones share layer i mod N's (models/build.py): a decoder
    # deeper than memory at its full depth and cost. None: every layer its own.
    distinct_layers: int | None = None
    # Method hyperparameters, each to every variant whose method has it ({"contextual_mode": "mean"}: ficoco's
    # corrections of the official code, which every row's method_label then names).
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    # The `preset` the keep came from (errors name it); not in the report, whose keep holds it.
    preset: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # keep == preset is this config after the fold (dataclasses.replace passes both back).
        keep = None if self.preset is not None and self.keep == self.preset else self.keep
        request = ScheduleRequest(keep=keep, preset=self.preset, tflops=self.tflops, schedule=self.schedule,
                                  shape=self.shape, first_layer=self.first_layer)
        if self.preset is not None:
            object.__setattr__(self, "keep", self.preset)
        object.__setattr__(self, "_request", request.folded())

    @property
    def request(self) -> ScheduleRequest:
        """The schedule request of every reducing row (the preset folded into keep)."""
        return self._request  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def with_request(cls, model: str, request: ScheduleRequest, **settings: Any) -> ProfileConfig:
        """A config whose schedule is `request` (its preset folded into keep); `settings` are the other fields."""
        return cls(model=model, keep=request.keep, preset=request.preset, tflops=request.tflops,
                   schedule=request.to_json()["schedule"], shape=request.shape, first_layer=request.first_layer,
                   **settings)

    def to_json(self) -> dict[str, Any]:
        """The report's `config`: every field but `preset` (keep holds it), in the fields' order."""
        data = asdict(self)
        del data["preset"]
        return data


def parse_batches(text: str) -> tuple[int, ...]:
    """`1,8` -> (1, 8)."""
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise FicocoError(f"batches='{text}' must list positive whole numbers, e.g. 1,8")
        values.append(int(part))
    if not values:
        raise FicocoError("batches= is empty; give batch sizes such as 1,8")
    return tuple(dict.fromkeys(values))
