"""Shared fixtures: profile architectures, built once per session (they are frozen).

The suite runs torch on one thread (also in the `ficoco` subprocesses it starts): tests time
nothing, and on a shared 2-core machine two OpenMP threads make small ops wait for a busy
core, which slowed the suite several-fold.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is pinned to the CPU, also on a machine with a GPU (and in the `ficoco`
# subprocesses it starts): its figures and the CI reference are CPU figures, and `--device
# auto` would otherwise move them. Tests marked `gpu` run only with FICOCO_GPU_TESTS=1, which
# leaves the GPUs visible: `FICOCO_GPU_TESTS=1 python -m pytest -m gpu`.
os.environ.update({} if os.environ.get("FICOCO_GPU_TESTS") == "1" else {"CUDA_VISIBLE_DEVICES": ""})
# The memory guard reads what the machine has free, which depends on what else runs there: tests
# that plan 7B models would pass on an idle machine and fail on a busy one. They see 64 GB free;
# the guard's own tests set (or remove) this per test.
os.environ.setdefault("FICOCO_TEST_FREE_MEMORY_BYTES", "64e9")

import pytest
from helpers import run_cli

from ficoco.accounting import Architecture, architecture
from ficoco.profiles import load_profile


@pytest.fixture(scope="session")
def cli() -> Any:
    """The one CLI runner of the suite: `cli("flops", "--model", ...)` -> CliResult(code, out, err);
    `cli(..., in_subprocess=True)` in a real process (helpers.run_cli, which hypothesis tests call
    directly: a fixture cannot be drawn inside @given)."""
    return run_cli


GPU_TESTS = os.environ.get("FICOCO_GPU_TESTS") == "1"


# The contract with transformers' internals (ficoco.models.hf_compat) is checked first: on a release
# that changed a contact, its tests fail with one line naming it, and the behavioural tests that run
# the patched models are skipped with that line instead of failing deep inside a forward.
CONTRACT_TESTS = "test_transformers_contract.py"
# The tests that run patched transformers models (marked `transformers`): .ci/run runs them on the
# oldest release pyproject.toml allows as well (`-m transformers`).
TRANSFORMERS_TESTS = frozenset({
    CONTRACT_TESTS, "test_models_llava.py", "test_models_llava_next.py", "test_models_qwen2_vl.py",
    "test_models_qwen2_5_vl.py", "test_models_llava_onevision.py", "test_models_video_llava.py",
    "test_hf_idioms.py", "test_kv_cache.py", "test_quantize.py", "test_real_inputs.py", "test_verify.py",
    "test_methods_llm_in_models.py", "test_methods_vision_in_models.py", "test_methods_vision_in_llava_next.py",
    "test_methods_diversity.py", "test_methods_holitom.py",
})
TRANSFORMERS_TESTS |= {"test_models_qwen3_5.py"}  # issue 34
TRANSFORMERS_TESTS |= {"test_models_internvl.py"}
TRANSFORMERS_TESTS |= {"test_eval_session.py"}  # issue 35: ficoco's lmms-eval model without lmms-eval
TRANSFORMERS_TESTS |= {"test_profile_kernels.py"}  # issue 41: the attention kernel every layer ran
# Of those, the suites of the methods inside the models (marked `method_suites` too): they reach
# transformers only through the adapters' hook points, which every family's model tests cross with
# FiCoCo-V and -L, so CI's oldest-release run leaves them out to keep the whole run under 15 minutes.
METHOD_SUITES = frozenset({"test_methods_llm_in_models.py", "test_methods_vision_in_models.py",
                           "test_methods_vision_in_llava_next.py", "test_methods_diversity.py",
                           "test_methods_holitom.py"})
# Issue 53: every method's official-rule test (tests/test_rule_<method>.py) runs patched tiny models through the
# adapters' hook points, as the method suites do: marked `transformers` and `method_suites` by their name.
RULE_TESTS_PREFIX = "test_rule_"
# Issue 53: the 2025-2026 methods' suites inside the models.
NEW_METHOD_SUITES = frozenset({"test_method_gprune.py", "test_method_vtw.py", "test_method_vtw_cli.py",
                               "test_method_vtw_families.py"})
NEW_METHOD_SUITES |= {"test_method_mustdrop.py"}
TRANSFORMERS_TESTS |= NEW_METHOD_SUITES
METHOD_SUITES |= NEW_METHOD_SUITES


# Files whose module fixtures run lmms-eval several times (minutes on a 2-core CPU).
LONGEST_FIRST = frozenset({"test_eval_lmms.py", "test_cli_eval.py"})
LONGEST_FIRST |= {"test_gpu_run.py"}  # issue 43: benchmarks/gpu_run.sh on the CPU, about a minute


def pytest_report_header(config: pytest.Config) -> str:
    from ficoco.versions import package_versions

    return "ficoco tested ranges: " + "; ".join(p.describe() for p in package_versions())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The contract tests first and the transformers tests marked; a changed contact skips the
    behavioural ones; `gpu` tests need FICOCO_GPU_TESTS=1 and a CUDA device torch can use."""
    # Stable: the contract first, then the longest files (the lmms-eval runs, minutes each), so that on two
    # workers they overlap the many short files rather than run alone at the end; the rest keep their order.
    items.sort(key=lambda item: (item.path.name != CONTRACT_TESTS, item.path.name not in LONGEST_FIRST))
    sensitive = [item for item in items
                 if item.path.name in TRANSFORMERS_TESTS or item.path.name.startswith(RULE_TESTS_PREFIX)]
    for item in sensitive:
        item.add_marker(pytest.mark.transformers)
        if item.path.name in METHOD_SUITES or item.path.name.startswith(RULE_TESTS_PREFIX):
            item.add_marker(pytest.mark.method_suites)
    if any(item.path.name != CONTRACT_TESTS for item in sensitive):
        from ficoco.models.hf_compat import check_contacts

        problems = check_contacts()
        if problems:
            skip = pytest.mark.skip(reason=f"skipped: {problems[0]}")
            for item in sensitive:
                if item.path.name != CONTRACT_TESTS:
                    item.add_marker(skip)
    if GPU_TESTS:
        import torch

        if torch.cuda.is_available():
            return
        reason = "FICOCO_GPU_TESTS=1 but torch sees no CUDA device"
    else:
        reason = "GPU test: run with FICOCO_GPU_TESTS=1 python -m pytest -m gpu"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def flops_verify(tmp_path):
    """`flops_verify("--model", "llava-tiny", "--variant", "fastv", ...)`: `ficoco flops --verify` run in this
    process (the same command, without a new interpreter's seconds of imports) and its JSON report; a
    failed verdict exits 1 (SystemExit), which fails the test."""
    return functools.partial(_json_report, tmp_path / "verify.json", "flops", "--verify")


@pytest.fixture
def flops_report(tmp_path):
    """`flops_report("--model", "llava-1.5-7b", ...)`: `ficoco flops ARGS --json FILE` run in this process
    and its JSON report; a user's mistake raises its FicocoError."""
    return functools.partial(_json_report, tmp_path / "flops_report.json", "flops")


def _json_report(path: Path, *args: str) -> dict:
    """The report `ficoco ARGS --json PATH` writes, the command run by the suite's runner as the bare app."""
    run_cli(*args, "--json", path, standalone=False)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> Any:
    """The tiny model of a module that names one (`TINY_PROFILE = "llava-tiny"`): seeded random weights in
    fp32, built once per module, so one module's patches and state never reach another's."""
    import ficoco

    return ficoco.build_model(request.module.TINY_PROFILE, dtype="fp32")


@functools.cache
def _architecture(name: str) -> Architecture:
    return architecture(load_profile(name))


@pytest.fixture(scope="session")
def arch_of():
    """`arch_of("llava-tiny")`: the architecture of a shipped profile at its default input."""
    return _architecture


@pytest.fixture(autouse=True)
def _no_grad_and_unpatched(request: pytest.FixtureRequest) -> Iterator[None]:
    """Model tests (test_models_*): inference only, and a failing test must not leave a patched
    model to the next one."""
    if not request.node.module.__name__.rpartition(".")[2].startswith("test_models_"):
        yield
        return
    import torch

    with torch.no_grad():
        yield
    for name in ("model", "gqa_model"):
        if name in request.fixturenames:
            handle = request.getfixturevalue(name).__dict__.get("_ficoco_handle")
            if handle is not None:
                handle.remove()
