"""Properties of the cost model and of schedules (hypothesis).

- costs never drop when tokens grow: more text tokens, more kept tokens, a larger batch;
- schedules remove exactly what they claim, and the token plan follows them layer by layer;
- a budget's schedule fits the budget and is maximal (one more kept token would not fit);
- `parse_schedule` round-trips.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ficoco.accounting import BudgetError, CountOptions, account, make_quant, resolve_schedule
from ficoco.accounting.flops import CONVENTIONS, LLM_ONLY_CONVENTIONS, SCOPES
from ficoco.accounting.schedule import (
    Schedule,
    first_layer,
    layer_range,
    min_kept_units,
    parse_schedule,
    plan_tokens,
    schedule_for_keep,
    total_units,
    uniform_schedule,
)
from ficoco.errors import FicocoError

FAST = settings(max_examples=50, deadline=None, derandomize=True, database=None)

TINY = ["llava-tiny", "llava-gqa-tiny", "llava-next-tiny", "qwen2-vl-tiny", "video-llava-tiny", "llava-onevision-tiny"]
PROFILES = [*TINY, "llava-1.5-7b"]
COUNTINGS = [(c, s) for c in CONVENTIONS for s in SCOPES if not (c in LLM_ONLY_CONVENTIONS and s == "all")]
FP16 = make_quant("fp16")

profiles = st.sampled_from(PROFILES)
variants = st.sampled_from(["v", "l"])
countings = st.sampled_from(COUNTINGS)
shapes = st.sampled_from(["uniform", "oneshot"])


def cost(arch, schedule, convention, scope, *, equivalent=False, batch=1, text_tokens=None):
    opts = CountOptions(convention=convention, scope=scope, equivalent=equivalent, batch=batch,
                        text_tokens=text_tokens)
    return account(arch, schedule, FP16, opts)


def removable(arch, variant):
    return total_units(arch, variant) - min_kept_units(arch, variant)


@st.composite
def reductions(draw):
    """(profile name, variant, fraction of the removable units to remove)."""
    name = draw(profiles)
    variant = draw(variants)
    return name, variant, draw(st.floats(0, 1))


def removed_units(arch, variant, fraction):
    return round(fraction * removable(arch, variant))


# ---- monotonicity -----------------------------------------------------------------------------------------

@FAST
@given(case=reductions(), counting=countings, shape=shapes, equivalent=st.booleans(),
       text=st.integers(1, 200), more=st.integers(1, 300))
def test_cost_does_not_drop_with_more_text_tokens(arch_of, case, counting, shape, equivalent, text, more):
    name, variant, fraction = case
    arch = arch_of(name)
    sched = uniform_schedule(arch, variant, removed_units(arch, variant, fraction), shape=shape)
    low = cost(arch, sched, *counting, equivalent=equivalent, text_tokens=text)
    high = cost(arch, sched, *counting, equivalent=equivalent, text_tokens=text + more)
    assert low.tflops <= high.tflops
    assert low.kv_cache_bytes < high.kv_cache_bytes
    assert low.memory_access_bytes <= high.memory_access_bytes


@FAST
@given(case=reductions(), counting=countings, shape=shapes, equivalent=st.booleans(), fewer=st.floats(0, 1))
def test_cost_does_not_drop_with_more_kept_tokens(arch_of, case, counting, shape, equivalent, fewer):
    name, variant, fraction = case
    arch = arch_of(name)
    removed = removed_units(arch, variant, fraction)
    removed_less = round(removed * fewer)  # keeps at least as many tokens
    many = cost(arch, uniform_schedule(arch, variant, removed, shape=shape), *counting, equivalent=equivalent)
    more_kept = cost(arch, uniform_schedule(arch, variant, removed_less, shape=shape), *counting,
                     equivalent=equivalent)
    assert many.tflops <= more_kept.tflops
    assert many.kv_cache_bytes <= more_kept.kv_cache_bytes
    assert many.plan.visual_tokens <= more_kept.plan.visual_tokens


@FAST
@given(case=reductions(), counting=countings, equivalent=st.booleans(), batch=st.integers(1, 8),
       more=st.integers(1, 8))
def test_cost_does_not_drop_with_larger_batch(arch_of, case, counting, equivalent, batch, more):
    name, variant, fraction = case
    arch = arch_of(name)
    sched = uniform_schedule(arch, variant, removed_units(arch, variant, fraction))
    small = cost(arch, sched, *counting, equivalent=equivalent, batch=batch)
    large = cost(arch, sched, *counting, equivalent=equivalent, batch=batch + more)
    assert small.tflops <= large.tflops
    assert small.kv_cache_bytes < large.kv_cache_bytes


@pytest.mark.parametrize("convention,scope", COUNTINGS)
def test_cost_falls_as_more_tokens_are_removed_llava7b(arch_of, convention, scope):
    arch = arch_of("llava-1.5-7b")
    for variant in ("v", "l"):
        costs = [cost(arch, uniform_schedule(arch, variant, r), convention, scope).tflops for r in range(0, 576, 25)]
        assert costs == sorted(costs, reverse=True)
        assert costs[-1] < costs[0]


# ---- schedules sum to what they claim ----------------------------------------------------------------------

@FAST
@given(case=reductions(), shape=shapes, data=st.data())
def test_uniform_schedule_removes_exactly_what_it_is_asked(arch_of, case, shape, data):
    name, variant, fraction = case
    arch = arch_of(name)
    valid = layer_range(arch, variant)
    default_first = arch.first_reducing_layer(variant)
    first = data.draw(st.sampled_from([None, valid.start, default_first, valid.stop - 1]))
    removed = removed_units(arch, variant, fraction)
    sched = uniform_schedule(arch, variant, removed, shape=shape, first=first)
    start = default_first if first is None else first
    assert sched.total_removed == removed
    assert all(r.remove > 0 and r.stage == ("vision" if variant == "v" else "llm") for r in sched.removals)
    layers = [r.layer for r in sched.removals]
    assert layers == sorted(layers) and all(start <= layer < valid.stop for layer in layers)
    if shape == "oneshot" and removed:
        assert sched.removed_at() == {start: removed}
    if shape == "uniform":
        per_layer = [sched.removed_at().get(layer, 0) for layer in range(start, valid.stop)]
        assert max(per_layer) - min(per_layer) <= 1
        assert per_layer == sorted(per_layer, reverse=True)  # extra removals go to the earliest layers


def valid_keeps(arch, variant):
    if variant == "l":
        return range(min_kept_units(arch, "l"), arch.visual_tokens + 1)
    return [arch.llm_visual_tokens(u) for u in range(1, arch.vision.units + 1)]


@FAST
@given(name=profiles, variant=variants, shape=shapes, data=st.data())
def test_schedule_for_keep_keeps_exactly_keep_and_plan_follows_removals(arch_of, name, variant, shape, data):
    arch = arch_of(name)
    keep = data.draw(st.sampled_from(list(valid_keeps(arch, variant))))
    sched = schedule_for_keep(arch, variant, keep, shape=shape)
    plan = plan_tokens(arch, sched)
    assert plan.visual_tokens == keep
    removed = sched.removed_at()
    v = arch.vision
    if variant == "l":
        assert sched.total_removed == arch.visual_tokens - keep
        assert plan.llm[0][0] == plan.text_tokens + arch.visual_tokens
        assert all(n_in == n_out for n_in, n_out in plan.vision)
    else:
        assert sched.total_removed == v.units - (keep - arch.newline_tokens - v.items * arch.cls_in_llm) // v.items
        assert plan.vision[0][0] == v.patches + v.has_cls
        assert all(n_in == n_out for n_in, n_out in plan.llm)
        assert plan.llm[0][0] == plan.text_tokens + keep
    stage_plan = plan.llm if variant == "l" else plan.vision
    unit = 1 if variant == "l" else v.merge
    for layer, (n_in, n_out) in enumerate(stage_plan):
        assert n_in - n_out == removed.get(layer, 0) * unit
        if layer:
            assert n_in == stage_plan[layer - 1][1]


def test_oneshot_puts_everything_at_the_first_layer(arch_of):
    arch = arch_of("llava-1.5-7b")
    assert schedule_for_keep(arch, "v", 64, shape="oneshot").to_json() == [
        {"stage": "vision", "layer": 12, "remove": 512}]
    assert schedule_for_keep(arch, "l", 64, shape="oneshot").to_json() == [{"stage": "llm", "layer": 4, "remove": 512}]
    assert schedule_for_keep(arch, "l", 64, shape="oneshot", first=7).removed_at() == {7: 512}


def test_uniform_default_layers_llava7b(arch_of):
    arch = arch_of("llava-1.5-7b")
    # V: 512 over layers 12..22 (11 layers) = 46 each, the 6 extra to the earliest layers
    assert schedule_for_keep(arch, "v", 64).removed_at() == {layer: 47 if layer < 18 else 46 for layer in range(12, 23)}
    # L: 512 over layers 4..31 (28 layers) = 18 each, the 8 extra to the earliest layers
    assert schedule_for_keep(arch, "l", 64).removed_at() == {layer: 19 if layer < 12 else 18 for layer in range(4, 32)}


# ---- budgets ----------------------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(name=profiles, variant=variants, counting=countings, equivalent=st.booleans(), shape=shapes,
       position=st.floats(0, 1.2))
def test_budget_schedule_fits_and_is_maximal(arch_of, name, variant, counting, equivalent, shape, position):
    arch = arch_of(name)
    units, low = total_units(arch, variant), min_kept_units(arch, variant)

    def tera(kept):
        return cost(arch, uniform_schedule(arch, variant, units - kept, shape=shape), *counting,
                    equivalent=equivalent).tflops

    cheapest, vanilla = tera(low), tera(units)
    budget = cheapest + position * (vanilla - cheapest) if position < 1 else vanilla * position
    opts = CountOptions(convention=counting[0], scope=counting[1], equivalent=equivalent)
    sched = resolve_schedule(arch, variant, opts, tflops=budget, shape=shape)
    kept = units - sched.total_removed
    assert low <= kept <= units
    assert tera(kept) <= budget
    assert cost(arch, sched, *counting, equivalent=equivalent).tflops <= budget
    if kept < units:
        assert tera(kept + 1) > budget  # maximal: one more kept token would not fit
    if position >= 1:
        assert kept == units


@FAST
@given(name=profiles, variant=variants, counting=countings, equivalent=st.booleans(), below=st.floats(0.01, 0.9))
def test_budget_below_the_cheapest_schedule_is_refused(arch_of, name, variant, counting, equivalent, below):
    arch = arch_of(name)
    units, low = total_units(arch, variant), min_kept_units(arch, variant)
    cheapest = cost(arch, uniform_schedule(arch, variant, units - low), *counting, equivalent=equivalent).tflops
    opts = CountOptions(convention=counting[0], scope=counting[1], equivalent=equivalent)
    with pytest.raises(BudgetError) as info:
        resolve_schedule(arch, variant, opts, tflops=cheapest * (1 - below), shape="uniform")
    assert f"costs {cheapest:.3g}" in str(info.value)


@FAST
@given(name=profiles, variant=variants, counting=countings, equivalent=st.booleans(),
       fraction=st.floats(0.05, 1.5))
def test_the_budget_default_shape_is_the_longest_uniform_run_that_fits(arch_of, name, variant, counting, equivalent,
                                                                       fraction):
    # Without --shape: today's uniform schedule whenever that reaches the budget, else uniform over the
    # longest run of layers from the first reducing layer whose cheapest schedule fits (oneshot at the limit).
    arch = arch_of(name)
    units, low = total_units(arch, variant), min_kept_units(arch, variant)
    start, stop = first_layer(arch, variant), layer_range(arch, variant).stop
    opts = CountOptions(convention=counting[0], scope=counting[1], equivalent=equivalent)

    def cheapest(run: int) -> float:
        return cost(arch, uniform_schedule(arch, variant, units - low, run=run), *counting,
                    equivalent=equivalent).tflops

    budget = cheapest(stop - start) * fraction
    fitting = [run for run in range(1, stop - start + 1) if cheapest(run) <= budget]
    if not fitting:
        with pytest.raises(BudgetError):
            resolve_schedule(arch, variant, opts, tflops=budget)
        return
    schedule = resolve_schedule(arch, variant, opts, tflops=budget)
    assert cost(arch, schedule, *counting, equivalent=equivalent).tflops <= budget
    layers = [r.layer for r in schedule.removals]
    assert layers == list(range(start, start + len(layers)))
    if fitting[-1] == stop - start:
        assert schedule == resolve_schedule(arch, variant, opts, tflops=budget, shape="uniform")
    else:
        assert len(layers) <= max(fitting) and "longest run" in dict(schedule.settings)["shape"]


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_budget_that_is_not_a_finite_number_above_0_is_refused(arch_of, budget):
    # nan used to pass `budget <= 0` and plan one kept token; inf planned no reduction at all.
    with pytest.raises(FicocoError, match="give a finite number above 0"):
        resolve_schedule(arch_of("llava-1.5-7b"), "v", CountOptions(), tflops=budget)


# ---- parse_schedule ---------------------------------------------------------------------------------------

@FAST
@given(name=profiles, variant=variants, data=st.data())
def test_parse_schedule_round_trips(arch_of, name, variant, data):
    arch = arch_of(name)
    valid = layer_range(arch, variant)
    layers = data.draw(st.lists(st.sampled_from(list(valid)), unique=True, max_size=6))
    budget = removable(arch, variant)
    removals = {}
    for layer in layers:
        removals[layer] = data.draw(st.integers(0, budget))
        budget -= removals[layer]
    order = data.draw(st.permutations(list(removals)))
    text = " , ".join(f"{layer}:{removals[layer]}" for layer in order)
    sched = parse_schedule(text, arch, variant)
    assert sched.removed_at() == {layer: r for layer, r in removals.items() if r}
    assert sched.total_removed == sum(removals.values())
    again = parse_schedule(",".join(f"{r['layer']}:{r['remove']}" for r in sched.to_json()), arch, variant)
    assert again == sched


@pytest.mark.parametrize("text", ["12-40", "12:", ":40", "12:40:1", "a:b", "12:-4", "12:4.5"])
def test_parse_schedule_rejects_bad_syntax(arch_of, text):
    with pytest.raises(FicocoError, match="LAYER:REMOVED"):
        parse_schedule(text, arch_of("llava-1.5-7b"), "v")


def test_parse_schedule_rejects_duplicates_ranges_and_overdraws(arch_of):
    arch = arch_of("llava-1.5-7b")
    with pytest.raises(FicocoError, match="twice"):
        parse_schedule("12:4,12:5", arch, "v")
    with pytest.raises(FicocoError, match=r"outside the vision tower's reducing layers 0\.\.22"):
        parse_schedule("23:4", arch, "v")
    with pytest.raises(FicocoError, match=r"outside the decoder's reducing layers \d+\.\.31"):
        parse_schedule("32:4", arch, "l")
    with pytest.raises(FicocoError, match="more visual tokens than exist"):
        parse_schedule("12:300,13:276", arch, "v")  # all 576: none left to fold into
    assert parse_schedule("12:300,13:275", arch, "v").total_removed == 575
    assert parse_schedule("", arch, "l") == Schedule("l")
