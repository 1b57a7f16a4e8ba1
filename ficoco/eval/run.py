"""One evaluated point in this process: lmms-eval's evaluator run on ficoco's model with the point's method
and budget, its scores joined with the run's own `ficoco.eval/1` record (what `ficoco eval` and
`ficoco sweep --eval` run in each point's worker).

lmms-eval is imported here only: a machine without the `eval` extra gets one line saying what to install.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ficoco.errors import FicocoError

INSTALL = ("lmms-eval is not installed: pip install -e \".[eval]\" (docs/evaluation.md says how on a CPU-only "
           "machine)")


def require_lmms_eval() -> str:
    """lmms-eval's version, or one FicocoError line that says how to install it."""
    try:
        from importlib.metadata import version

        import lmms_eval  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken dependency of it (torchvision)
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("lmms_eval", None):
            raise FicocoError(INSTALL) from None
        raise FicocoError(f"lmms-eval does not import here ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                          "docs/evaluation.md, Install, says how to install it") from None
    return version("lmms-eval")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else None


def task_scores(results: Mapping[str, Any], tasks: Sequence[str]) -> dict[str, Any]:
    """Each task's score as lmms-eval reports it: the first metric of the task's metric_list (its primary
    one), under the "none" filter where there is one, with its stderr and direction, and every numeric metric."""
    scores: dict[str, Any] = {}
    all_results = results.get("results") or {}
    for task in tasks:
        found = all_results.get(task)
        if not isinstance(found, Mapping):
            scores[task] = {"metric": None, "score": None, "samples": None, "metrics": {},
                            "reason": "lmms-eval reported no result for this task"}
            continue
        metrics = {key: value for key, value in found.items() if _number(value) is not None and "_stderr" not in key}
        config = (results.get("configs") or {}).get(task) or {}
        listed = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, Mapping)]
        names = [key.split(",")[0] for key in metrics]
        primary = next((m for m in listed if m in names), names[0] if names else None)
        key = next((k for k in metrics if k.split(",")[0] == primary and k.endswith(",none")),
                   next((k for k in metrics if k.split(",")[0] == primary), None))
        stderr_key = key.replace(",", "_stderr,", 1) if key else None
        higher = ((results.get("higher_is_better") or {}).get(task) or {}).get(primary, True)
        samples = (results.get("n-samples") or {}).get(task) or {}
        scores[task] = {"metric": primary, "score": metrics.get(key) if key else None,
                        "stderr": _number(found.get(stderr_key)) if stderr_key else None,
                        "higher_is_better": bool(higher), "samples": samples.get("effective"),
                        "metrics": {k: float(v) for k, v in metrics.items()}}
    return scores


def quiet_logs(level: str = "WARNING") -> None:
    """lmms-eval logs through loguru, whose default handler prints every debug line (its task index alone
    prints hundreds): only `level` and above go to stderr in this process."""
    import sys

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=level)


def task_manager(include_paths: Sequence[str] = (), log_level: str = "WARNING", *,
                 include_defaults: bool = True) -> Any:
    """lmms-eval's task index, with the folders of task YAML outside lmms-eval (one line for a missing one);
    `include_defaults=False` indexes those folders alone."""
    require_lmms_eval()
    quiet_logs(log_level)
    for folder in include_paths:
        if not Path(folder).expanduser().is_dir():
            raise FicocoError(f"eval_include={folder}: no such folder (it holds the task YAML files)")
    from lmms_eval.tasks import TaskManager

    return TaskManager("WARNING", include_path=[str(Path(p).expanduser()) for p in include_paths] or None,
                       include_defaults=include_defaults, model_name="ficoco")


def check_tasks(tasks: Sequence[str], include_paths: Sequence[str] = (), log_level: str = "WARNING") -> Any:
    """The task index when lmms-eval knows every task of `tasks`; otherwise one line naming the unknown ones.

    Indexing lmms-eval's own tasks parses its ~3,200 YAML files (about 25 s on a 2-core machine, in every process
    that evaluates), so where every task named is a plain task of the given folders, those folders alone are
    indexed; a group, a tag or a task found nowhere there takes the whole index, as lmms-eval builds it."""
    manager = None
    if include_paths:
        local = task_manager(include_paths, log_level, include_defaults=False)
        index = local.task_index
        if all(index.get(task, {}).get("type") == "task" for task in tasks):
            manager = local
    if manager is None:
        manager = task_manager(include_paths, log_level)
    missing = [task for task in tasks if task not in set(manager.all_tasks)]
    if missing:
        raise FicocoError(f"eval_tasks={','.join(tasks)}: lmms-eval knows no task {', '.join(missing)}; check the "
                          "name (`lmms-eval tasks list`) or give eval_include= with the folder of its YAML")
    return manager


def evaluate(model_args: Mapping[str, Any], tasks: Sequence[str], *, include_paths: Sequence[str] = (),
             limit: int | None = None) -> dict[str, Any]:
    """Run `tasks` through lmms-eval on ficoco's model built from `model_args` (the plugin's keys) and return
    the run's `ficoco.eval/1` record with the tasks' scores (`tasks`) and their mean (`score`), also written to
    the run's `out` (a model_args key). The task
    data is read as lmms-eval reads it; nothing is downloaded (the hub is offline for this call)."""
    version = require_lmms_eval()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    manager = check_tasks(tasks, include_paths)
    from lmms_eval import evaluator

    from ficoco.eval.lmms_model import FicocoLMM

    model = FicocoLMM(**model_args)
    results = evaluator.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, limit=limit,
                                        batch_size=model.batch_size, log_samples=False, verbosity="WARNING")
    if not results:
        raise FicocoError("lmms-eval returned no results (see its log above)")
    record = model.session.record()
    scores = task_scores(results, tasks)
    known_scores = [s["score"] for s in scores.values() if s.get("score") is not None]
    record.update(tasks=scores, score=sum(known_scores) / len(known_scores) if known_scores else None,
                  lmms_eval_version=version, throughput=results.get("throughput"))
    from ficoco.report import write_json_atomic

    write_json_atomic(model.session.out, record)  # the run's record, now with its scores
    return record
