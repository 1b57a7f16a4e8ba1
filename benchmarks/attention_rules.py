"""Where the model's eager rule and float32 scores keep different tokens.

    python benchmarks/attention_rules.py                          # every tiny profile, bf16
    python benchmarks/attention_rules.py --models qwen3-vl-8b --set text_config.num_hidden_layers=3 --variants v

Every method that reads attention probabilities reads them, by default, as the model's own eager attention
computes them (``attention_scores="model"``: the product and the scale in the model's dtype, the softmax in
float32, its result in the model's dtype); ``attention_scores="float32"`` is ficoco's earlier float32 probe, a
named correction. This runs each such method on each model (random weights, one synthetic prompt, the method's
official setting or a quarter of the visual tokens for FiCoCo) under both rules and compares, layer by layer,
the tokens kept: the same sets, or how many of them differ. In float32 the two rules differ only in rounding.
Nothing is timed.
"""

from __future__ import annotations

import argparse

import torch

import ficoco
from ficoco.accounting import architecture
from ficoco.api import profile_of
from ficoco.errors import FicocoError
from ficoco.methods import METHODS
from ficoco.models import synthetic_inputs
from ficoco.profiles import list_profiles

TINY = [name for name in list_profiles() if name.endswith("-tiny")]
READERS = [name for name, spec in METHODS.items() if "attention_scores" in spec.hyperparameters]


def kept_sets(model: torch.nn.Module, variant: str, inputs: dict, rule: str, keep: int | None) -> list[tuple]:
    """(stage, layer, kept indices per item) of every reducing layer of one forward under `rule`."""
    with torch.inference_mode(), ficoco.apply(model, variant, keep=keep, attention_scores=rule) as handle:
        model(**inputs)
        return [(r.stage, r.layer, r.kept.tolist()) for r in handle.records]


def compare(model: torch.nn.Module, variant: str, inputs: dict) -> str:
    spec = METHODS[variant]
    arch = architecture(profile_of(model))
    status, _ = spec.family_status(arch.family)
    if status != "yes":
        return f"not run on {arch.family} models"
    # The official setting, else the first of a few budgets this model reaches (a quarter of the visual tokens
    # first: FiCoCo's budget is a count by definition; a tiny model's layout admits only some counts).
    visual = arch.visual_tokens
    counts = [visual // 4, visual // 2, visual // 3, visual // 8, 16, 13, 12, 8, 4]
    budgets = ([] if spec.planner == "per_layer" else [None]) + list(dict.fromkeys(c for c in counts if c >= 1))
    error: Exception | None = None
    for keep in budgets:
        try:
            model_rule = kept_sets(model, variant, inputs, "model", keep)
            float32 = kept_sets(model, variant, inputs, "float32", keep)
            break
        except FicocoError as exc:
            error = error or exc
    else:
        return f"not run: {error}"
    differing = []
    for (stage, layer, kept), (_, _, other) in zip(model_rule, float32, strict=True):
        changed = sum(len(set(a) ^ set(b)) // 2 for a, b in zip(kept, other, strict=True))
        if changed:
            differing.append(f"{stage} {layer}: {changed}")
    total = sum(len(item) for _, _, kept in model_rule for item in kept)
    if not differing:
        return f"same kept tokens at all {len(model_rule)} reducing layers ({total} kept)"
    return f"differ at {len(differing)} of {len(model_rule)} layers ({'; '.join(differing)} token(s) swapped)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=TINY)
    parser.add_argument("--variants", nargs="*", default=READERS)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.models:
        model = ficoco.build_model(name, dtype=args.dtype, overrides=args.overrides)
        inputs = synthetic_inputs(model, batch=1, text_tokens=60, seed=0)
        for variant in args.variants:
            if variant not in METHODS:
                continue
            print(f"{name:22} {args.dtype:5} {variant:10} {compare(model, variant, inputs)}", flush=True)


if __name__ == "__main__":
    main()
