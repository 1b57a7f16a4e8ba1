"""The schema names of the reports ficoco writes, stated once: the library that builds a report,
the readers that check one (`ficoco report`, `ficoco compare`, a sweep's store) and the CLI
import them from here."""

from __future__ import annotations

REPORT_SCHEMA = "ficoco.report/1"  # a profile run: `ficoco profile --json`, `ficoco.profile(...)`
FLOPS_SCHEMA = "ficoco.flops/1"  # the accountant's costs: `ficoco flops --json`, `ficoco.flops(...)`
SWEEP_SCHEMA = "ficoco.sweep/1"  # every method at every budget point: `ficoco sweep --json`
METHODS_SCHEMA = "ficoco.methods/1"  # the registry: `ficoco methods --json`
# One evaluated run (a method at a budget through lmms-eval): its samples' answers and costs, its timing,
# and with `ficoco eval` its tasks' scores; written by the lmms-eval plugin, kept in an evaluated sweep's points.
EVAL_SCHEMA = "ficoco.eval/1"
