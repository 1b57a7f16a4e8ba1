"""VTW, visual tokens withdrawal (docs/methods/vtw.md): at the input of decoder layer K, prefill only, every visual
token leaves; layers K and later run, and cache, the text alone.

This module is its spec, its defaults (the official code's), its schedule arithmetic and the calibration rule that
picks K offline (`first_layer_within`, run by ficoco.methods.vtw.calibrate); no torch. Its tensor functions are in
`ops`.

Official code: lzhxmu/VTW @ a3d8cfc, llava/model/language_model/VTW.py (the withdrawal :308-314, the search
:234-265 and the KL :102-107) and lmms-evaluation/lmms_eval/__main__.py:388-400 (eta per checkpoint, the first K
within it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ficoco.errors import FicocoError
from ficoco.methods.base import ACTING_LAYERS, MethodSpec, Need, Step
from ficoco.methods.common import ALL_FAMILIES

LAYER = 15  # K: the README's `--use_vtw --k=15` for LLaVA-1.5-7B (temp_cache.k = 15, VTW.py:22)
# The search's first candidate: `for drop_layer_idx in range(5, len(self.layers))` (VTW.py:238).
FIRST_SEARCHED_LAYER = 5
SEARCH_SAMPLES = 20  # the README's `--limit 20` (ScienceQA-IMG samples) for `--findk`
# eta, the mean KL a withdrawal may cost, per checkpoint (lmms_eval/__main__.py:389-396): the first substring the
# model's name holds, in the official order; any other model: DEFAULT_ETA. ficoco's profiles name the HF
# checkpoints ("llava-hf/llava-1.5-7b-hf"), so each official name is matched in both spellings.
ETA_BY_CHECKPOINT: tuple[tuple[tuple[str, ...], float], ...] = (
    (("llava-v1.5-13b", "llava-1.5-13b"), 0.0005),
    (("llava-v1.5-7b", "llava-1.5-7b"), 0.003),
    (("llava-v1.6-vicuna-7b",), 0.0001),
)
DEFAULT_ETA = 0.003
# The position ids of the text at layers >= K: "original" (the official default `pe_type = "keep"`, VTW.py:18 and
# :314: gapped ids, decode from the full length) or "compact" (the official other `pe_type` branch, :322-328: ids
# re-packed after the withdrawal, decode from the cache length of layer K). ficoco's names for the two schemes.
POSITIONS = "original"
POSITION_CHOICES = ("original", "compact")


def check_withdrawal_layer(layer: Any, n_layers: int) -> int:
    """K as a layer of a decoder of `n_layers`: 1..L-1 withdraws at that layer's input; L never withdraws (the
    official code with k >= the decoder's depth: every layer sees every token). One line otherwise."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n_layers:
        raise FicocoError(f"VTW: layer {layer!r} is outside 1..{n_layers} (K, the decoder layer at whose input the "
                          f"visual tokens leave; {n_layers} withdraws none); find K with `ficoco calibrate vtw`")
    return layer


def check_positions(value: Any) -> str:
    """The position scheme setting, or one line naming the two."""
    if value not in POSITION_CHOICES:
        raise FicocoError(f"VTW: positions={value!r}: give original (the official pe_type='keep') or compact (the "
                          "official other pe_type: ids re-packed after the withdrawal)")
    return value


def layer_average(layer: int, n_visual: int, n_layers: int) -> float:
    """The visual tokens a decoder layer sees, averaged over the layers: K layers at all N, the rest at none."""
    return layer * n_visual / n_layers


def steps(settings: Mapping[str, Any], n_visual: int, n_layers: int) -> tuple[Step, ...]:
    """One step at layer K removing every visual token (none when K is the decoder's depth)."""
    layer = check_withdrawal_layer(settings["layer"], n_layers)
    return (Step(layer, n_visual),) if layer < n_layers else ()


def layer_for_keep(keep: int, n_visual: int, n_layers: int, acting: Sequence[int] | None = None) -> int:
    """K whose layer average K * N / L is nearest `keep` (ties: the smaller K, whose average is below), among the
    layers VTW may act at (`acting`; None: 1..L-1) and L (none withdrawn); a `keep` below the lowest average or above
    N is refused in one line."""
    candidates = [*(range(1, n_layers) if acting is None else acting), n_layers]
    first = candidates[0]
    if not (first * n_visual <= keep * n_layers and keep <= n_visual):
        low = -(-first * n_visual // n_layers)
        lowest = layer_average(first, n_visual, n_layers)
        where = f"1..{n_layers - 1}" if acting is None else f"{', '.join(map(str, acting))}"
        raise FicocoError(f"VTW withdraws at a decoder layer K in {where} of {n_layers}: its layer averages run from "
                          f"{lowest:g} (K={first}) to {n_visual} (none withdrawn) visual tokens; keep={keep} is "
                          f"outside {low}..{n_visual}")
    # |K N / L - keep| compared as |K N - keep L| on integers.
    return min(candidates, key=lambda k: (abs(k * n_visual - keep * n_layers), k))


def settings_for_keep(keep: int | None, n_visual: int, n_layers: int, hp: Mapping[str, Any]) -> dict[str, Any]:
    """The setting of the literature's "`keep` tokens" row: K whose layer average is nearest `keep`
    (`layer_for_keep`; on a hybrid decoder among the layers the accountant hands as ``ACTING_LAYERS``); None: the
    official K (hp ``layer``). The position scheme rides along."""
    positions = check_positions(hp["positions"])
    if keep is None:
        return {"layer": check_withdrawal_layer(hp["layer"], n_layers), "positions": positions}
    if hp["layer"] != LAYER:
        raise FicocoError(f"VTW: keep={keep} picks K itself; give keep= or the layer hyperparameter ({hp['layer']}), "
                          "not both")
    return {"layer": layer_for_keep(keep, n_visual, n_layers, hp.get(ACTING_LAYERS)), "positions": positions}


def default_eta(*names: str) -> tuple[float, str]:
    """(eta, why) for a model known by `names` (the model argument, the checkpoint's id): the official value of the
    first checkpoint name one of them holds (lmms_eval/__main__.py:389-396), else the official fallback."""
    lowered = [name.lower() for name in names if name]
    for spellings, eta in ETA_BY_CHECKPOINT:
        for name in lowered:
            found = next((spelling for spelling in spellings if spelling in name), None)
            if found is not None:
                return eta, f"the official eta of {spellings[0]} ({name} holds '{found}')"
    return DEFAULT_ETA, "the official eta of any other checkpoint"


def first_layer_within(mean_kl: Mapping[int, float], eta: float) -> int | None:
    """VTW's K: the first searched layer whose mean KL is at most `eta` (`(kl_results <= eta).nonzero()[0]`,
    lmms_eval/__main__.py:398-399); None when no layer is."""
    return next((layer for layer in sorted(mean_kl) if mean_kl[layer] <= eta), None)


SPEC = MethodSpec(
    name="vtw", title="VTW", acts_at="llm_layer", placement="layer_input", positions="original",
    needs=(Need("hidden", "L", "all", "the input of layer K, whose visual tokens all leave"),),
    hyperparameters={"layer": LAYER, "positions": POSITIONS},
    families=ALL_FAMILIES, module=f"{__name__}.ops", function="withdraw",
    source="lzhxmu/VTW a3d8cfc", summary="withdraw every visual token at decoder layer K (K calibrated offline)",
    keep_means="layer-average visual tokens: K = the layer whose average K * N / L is nearest",
    steps=steps, settings_for_keep=settings_for_keep, wired=True, removes_all=True,
)
