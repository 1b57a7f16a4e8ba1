#!/usr/bin/env bash
# The GPU smoke run: every CUDA path of ficoco on one GPU, in under 10 minutes on an H100.
# Each step prints what correct output looks like before it runs; the run stops at the first
# step that fails. Reports land in ${OUT:-gpu-smoke-out}/.
#
#   bash benchmarks/gpu_smoke.sh            # everything
#   SKIP_7B=1 bash benchmarks/gpu_smoke.sh  # without the 7B main job (about 1 minute)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-smoke-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
step() { printf '\n=== %s\n--- expect: %s\n' "$1" "$2"; }

step "1. environment" "torch with CUDA, 1+ device named, a driver version, bitsandbytes importable"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
import torch, bitsandbytes, transformers, ficoco
assert torch.cuda.is_available(), "torch cannot use a GPU here"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}; transformers {transformers.__version__}; "
      f"bitsandbytes {bitsandbytes.__version__}; ficoco {ficoco.__version__}")
PY

step "2. quantized at build" "int8 weights torch.int8 and int4 torch.uint8 right after the build; allocated memory within a few % of the measured weight bytes, which are within 0.5% of the accountant's"
python - <<'PY'
import gc, torch, bitsandbytes as bnb, ficoco
from ficoco.accounting import architecture
from ficoco.accounting.memory import make_quant, weight_bytes
from ficoco.profiles import load_profile
from ficoco.profiling.trackers import model_weight_bytes
over = ["text_config.num_hidden_layers=4"]
for quant, kind in (("fp16", None), ("int8", bnb.nn.Linear8bitLt), ("int4", bnb.nn.Linear4bit)):
    torch.cuda.reset_peak_memory_stats()
    model = ficoco.build_model("llava-1.5-7b", device="cuda", quant=quant, overrides=over)
    layers = [m for m in model.modules() if kind is not None and isinstance(m, kind)]
    dtypes = sorted({str(m.weight.dtype) for m in layers})
    measured = model_weight_bytes(model)
    analytic = weight_bytes(architecture(load_profile("llava-1.5-7b", over)), "all", make_quant(quant))
    allocated = torch.cuda.memory_allocated()
    print(f"{quant}: {len(layers)} bnb layers, weight dtypes {dtypes}; allocated {allocated / 1e9:.3f} GB, "
          f"measured weights {measured / 1e9:.3f} GB, analytic {analytic / 1e9:.3f} GB "
          f"({(measured / analytic - 1) * 100:+.2f}%), build peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    assert abs(measured / analytic - 1) < 0.005 and allocated < 1.05 * measured + 64e6
    assert quant == "fp16" or dtypes == (["torch.int8"] if quant == "int8" else ["torch.uint8"])
    del model, layers
    gc.collect(); torch.cuda.empty_cache()
PY

step "3. GPU tests" "every test passes: probe vs SDPA, no host sync per reducing layer (sync debug mode), CUDA profile fields"
FICOCO_GPU_TESTS=1 python -m pytest -q -m gpu tests/

step "4. every tiny family, fp16/int8/int4, batch 1 and 2, generation" "PASS for each report: cuda-events timer, allocator and NVML peaks, measured KV = analytic, weights within 0.5%"
for spec in "llava-tiny 8" "llava-gqa-tiny 8" "llava-next-tiny 48" "qwen2-vl-tiny 8" "video-llava-tiny 28"; do
  set -- $spec
  ficoco profile --device cuda --model "$1" --variant vanilla,v,l --keep "$2" --quant fp16,int8,int4 --batch 1,2 \
    --new-tokens 4 --json "$out/tiny-$1.json" > "$out/tiny-$1.txt"
  python benchmarks/check_report.py "$out/tiny-$1.json" cuda
done

step "5. a local checkpoint (save_pretrained, then --weights)" "PASS; the checkpoint loads offline, int8/int4 quantized by transformers at load"
python - "$out/ckpt" <<'PY'
import sys, ficoco
ficoco.build_model("llava-tiny").save_pretrained(sys.argv[1])
PY
ficoco profile --device cuda --model "$out/ckpt" --weights "$out/ckpt" --variant vanilla,v,l --keep 8 \
  --quant fp16,int8,int4 --json "$out/checkpoint.json" > "$out/checkpoint.txt"
python benchmarks/check_report.py "$out/checkpoint.json" cuda

if [ "${SKIP_7B:-0}" != 1 ]; then
  step "6. the main job: LLaVA-1.5-7B vanilla/V/L at keep 64, fp16/int8/int4, batch 1 and 8" "PASS; every method's speedup at least 0.9 of the predicted one (measured rates); measured/roofline above 1; int8 and int4 weights ~7.0 and ~3.9 GB"
  ficoco profile --device cuda --model llava-1.5-7b --variant vanilla,v,l --keep 64 --quant fp16,int8,int4 \
    --batch 1,8 --json "$out/main-7b.json" | tee "$out/main-7b.txt"
  python benchmarks/check_report.py "$out/main-7b.json" cuda

  step "7. a long LLaVA-NeXT-7B sequence (2,928 tokens) through the probe" "PASS; the L row's method share small; no OOM"
  ficoco profile --device cuda --model llava-next-7b --variant vanilla,v,l --keep 648 \
    --set text_config.num_hidden_layers=8 --json "$out/next-7b.json" > "$out/next-7b.txt"
  python benchmarks/check_report.py "$out/next-7b.json" cuda
fi
printf '\nGPU smoke run: all steps passed; reports in %s/\n' "$out"
