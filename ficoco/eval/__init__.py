"""Accuracy evaluation of reduced models (lmms-eval) and its join with the sweep's cost.

- `ficoco.eval.join`: an evaluated sweep report's points as rows (scores per task, the mean,
  retention and answer agreement against vanilla, TFLOPs, visual tokens, timings), torch-free:
  read by `ficoco report`, `ficoco compare` and the accuracy figure.

This package's `__init__` imports nothing: its modules are loaded on use.
"""
