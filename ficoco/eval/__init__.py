"""Accuracy beside cost: ficoco as an lmms-eval model (`lmms-eval --model ficoco`), and the records that
join an evaluated run's scores with its checked cost.

- `settings`: `--model_args` read into one `EvalSettings` (no torch);
- `session`: one run on a local checkpoint: requests laid out, the method applied, answers timed and costed;
- `lmms_model`, `plugin`: the lmms-eval model class and the entry point that registers it;
- `run`: one evaluated point run through lmms-eval in this process (what `ficoco eval` runs per point);
- `join`: an evaluated sweep's points joined into one table (retention, agreement with vanilla; no torch).
"""
