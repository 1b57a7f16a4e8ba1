"""The schema names of the reports ficoco writes, stated once: the library that builds a report,
the readers that check one (`ficoco report`, `ficoco compare`, a sweep's store) and the CLI
import them from here."""

from __future__ import annotations

REPORT_SCHEMA = "ficoco.report/1"  # a profile run: `ficoco profile --json`, `ficoco.profile(...)`
# Fields a /1 row gained without a new schema (readers take their absence as "not recorded"):
# `attention_kernels` {"vision"|"llm": [{"layers": [first, last], "implementation", "backend",
# "calls_per_layer", "reads", "via"}]}: the attention kernel every layer ran (ficoco.profiling.kernels);
# `slower_kernels_vs_vanilla` [{"stage", "layers": [[first, last], ...], "ran", "vanilla"}] or null: where a
# reduced row runs a slower kernel than its vanilla row in layers it does not reduce (ficoco.report.kernels).
FLOPS_SCHEMA = "ficoco.flops/1"  # the accountant's costs: `ficoco flops --json`, `ficoco.flops(...)`
SWEEP_SCHEMA = "ficoco.sweep/1"  # every method at every budget point: `ficoco sweep --json`
METHODS_SCHEMA = "ficoco.methods/1"  # the registry: `ficoco methods --json`
# One evaluated run (a method at a budget through lmms-eval): its samples' answers and costs, its timing,
# and with `ficoco eval` its tasks' scores; written by the lmms-eval plugin, kept in an evaluated sweep's points.
EVAL_SCHEMA = "ficoco.eval/1"
# Serving under load (`ficoco serve-bench`, ficoco.serving.vllm.bench): per variant and concurrency level, time to
# first token, requests/s and output tokens/s beside the accountant's TFLOPs and visual tokens per request.
SERVE_SCHEMA = "ficoco.serve/1"
