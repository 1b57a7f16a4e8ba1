#!/usr/bin/env bash
# The GPU run: every CUDA path of ficoco on one GPU, in one command, inside 9 minutes on an H100.
#
# Every step runs, whatever an earlier one did; each prints what correct output looks like and its time
# estimate, then PASS, FAIL or SKIPPED with one line why. A step that would not finish before the deadline
# (DEADLINE_S) is SKIPPED with that reason; one still running at the deadline is stopped and FAILs. At the end a
# summary in text and JSON. Everything comes back in 4 files under $OUT: summary.txt, summary.json,
# gpu_run.log (this output) and reports.tar.gz (every step's log, JSON reports and checks).
#
# On this project's lent GPU machine (no network; torch 2.11, transformers 5.17 and no bitsandbytes there):
#   bash benchmarks/gpu_wheels.sh        # here, once: the carried wheels into .gpu-wheels/, and the call's size
#   run(command="bash benchmarks/gpu_run.sh", carry=[".gpu-wheels"], timeout_s=580)
# The environment step installs the carried wheels offline where the machine's own are missing or older, and
# runs ficoco from the tree (PYTHONPATH); nothing reaches a network.
#
# On any other GPU machine (with network): install as docs/install.md says, then `bash benchmarks/gpu_run.sh`
# (without .gpu-wheels/ nothing is installed). On a CPU (the same steps on the tiny profiles; what needs CUDA
# is SKIPPED with why; tests/test_gpu_run.py runs it): `DEVICE=cpu bash benchmarks/gpu_run.sh`.
#
# Settings (environment):
#   DEVICE=cuda|cpu        where to run (default cuda)
#   SCOPE=full|smoke       smoke: the fewest rows that still cross every step's flags and report fields
#                          (a CPU runs SCOPE=full in about 20 minutes on 2 cores, smoke in about a minute)
#   DEADLINE_S=N           seconds for the whole run (default 540 on cuda, 3600 on a CPU)
#   STEPS=a,b              only these steps and the environment (the others are SKIPPED: not asked for)
#   JOBS=N                 tiny profile runs at once in tiny-methods (default 4 on cuda, 1 on a CPU)
#   INSTALL=auto|0         0: install nothing, whatever is carried
#   OUT=DIR                where the 4 files go (default gpu-run-out/, ignored by git)
#   PYTHON=python          the interpreter (default: python, else python3)

# The steps (and what they share) are functions called by name ("step_$name"), which shellcheck cannot follow.
# shellcheck disable=SC2329
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$ROOT/benchmarks/gpu_run.sh"
cd "$ROOT" || exit 2

# The steps, in order of value: name, title, what correct output looks like. Estimates below.
STEP_NAMES=(environment gpu-tests tiny-methods tiny-quant main-job qwen3-vl-8b qwen3.5-0.8b internvl3-8b
            device-map lmms-eval qwen3-vl-30b-a3b)
declare -A TITLE EXPECT EST_CUDA EST_CPU EST_SMOKE
TITLE[environment]="the environment: GPU, driver, torch, transformers, bitsandbytes; the carried wheels installed"
EXPECT[environment]="torch sees the GPU (cuda) or runs (cpu); ficoco imports from this tree; quant and pytest ready"
TITLE[gpu-tests]="the gpu-marked tests (FICOCO_GPU_TESTS=1 pytest -m gpu)"
EXPECT[gpu-tests]="cuda: every test passes (probe vs SDPA, Triton reads vs eager, no host sync per reducing layer, CUDA report fields, GPU split), then the reads timed beside SDPA; cpu: each collects and skips cleanly"
TITLE[tiny-methods]="all 14 variants on every tiny family, fp16 (cpu: its fastest dtype)"
EXPECT[tiny-methods]="PASS per report from check_report.py; every variant a family runs has an ok row, those it refuses are listed with why"
TITLE[tiny-quant]="int8 and int4 weights on two tiny families (LLaVA, InternVL3), batch 1 and 2, new tokens; a local checkpoint"
EXPECT[tiny-quant]="PASS per report: weights within 0.5 % of the accountant, quantized KV cache = analytic; the checkpoint loads offline, quantized at load"
TITLE[main-job]="the main job: LLaVA-1.5-7B at 1.5 TFLOPs, vanilla/V/L/FastV/VisionZip/DivPrune, fp16/int8/int4, batch 1 and 8"
EXPECT[main-job]="PASS: every reduced row at least 0.9 of its predicted speedup; int8/int4 weights ~7.0/~3.9 GB; L at the oneshot shape (uniform does not fit 1.5)"
TITLE[qwen3-vl-8b]="Qwen3-VL-8B at its real shapes, bf16, SDPA, keep 144, batch 1 and 8, 8 new tokens"
EXPECT[qwen3-vl-8b]="PASS; vanilla's SDPA on a fused backend; each method at least 0.9 of its predicted speedup"
TITLE[qwen3.5-0.8b]="Qwen3.5-0.8B (Gated DeltaNet + attention), bf16, keep 144, FastV at layer 4, batch 1 and 8, 8 new tokens"
EXPECT[qwen3.5-0.8b]="PASS; the DeltaNet state in the KV figure; FastV at layer 4 (layer 2 reads a DeltaNet layer and is refused)"
TITLE[internvl3-8b]="InternVL3-8B, one 448x448 tile, bf16, keep 64, batch 1 and 8, 8 new tokens"
EXPECT[internvl3-8b]="PASS; 256 visual tokens per tile to 64"
TITLE[device-map]="a device map: llava-tiny split over two places (cuda: GPU and CPU memory; cpu: CPU memory and disk)"
EXPECT[device-map]="PASS; the map puts modules on two places; each row's resident weights as the accountant places them"
TITLE[lmms-eval]="the lmms-eval plugin (lmms-eval --model ficoco) on a tiny LLaVA checkpoint"
EXPECT[lmms-eval]="both runs exit 0 with 4 logged samples and a ficoco.eval/1 record (SKIPPED where lmms-eval is not installed)"
TITLE[qwen3-vl-30b-a3b]="Qwen3-VL-30B-A3B (MoE, 61 GB of bf16 weights) where the GPU's free memory allows, batch 1"
EXPECT[qwen3-vl-30b-a3b]="PASS; SKIPPED with the sizes where the weights and 4 GB do not fit"
# Seconds. cuda: guessed, not yet measured (no GPU has run this); cpu: measured on this project's 2-core VM
# while other work shared it (smoke: 0 for a step that only says why it does not run).
EST_CUDA=([environment]=40 [gpu-tests]=60 [tiny-methods]=110 [tiny-quant]=60 [main-job]=160 [qwen3-vl-8b]=70
          [qwen3.5-0.8b]=45 [internvl3-8b]=70 [device-map]=20 [lmms-eval]=45 [qwen3-vl-30b-a3b]=150)
EST_CPU=([environment]=10 [gpu-tests]=15 [tiny-methods]=600 [tiny-quant]=200 [main-job]=200 [qwen3-vl-8b]=30
         [qwen3.5-0.8b]=30 [internvl3-8b]=30 [device-map]=20 [lmms-eval]=70 [qwen3-vl-30b-a3b]=0)
EST_SMOKE=([environment]=8 [gpu-tests]=0 [tiny-methods]=20 [tiny-quant]=30 [main-job]=20 [qwen3-vl-8b]=25
           [qwen3.5-0.8b]=0 [internvl3-8b]=0 [device-map]=20 [lmms-eval]=0 [qwen3-vl-30b-a3b]=0)
ALL_VARIANTS=vanilla,v,l,fastv,pdrop,sparsevlm,dart,tome,visionzip,fastervlm,prumerge,divprune,vispruner,cdpruner
MAIN_VARIANTS=vanilla,v,l,fastv,visionzip,divprune
TINY_MODELS=llava-tiny,llava-gqa-tiny,llava-next-tiny,llava-onevision-tiny,qwen2-vl-tiny,qwen2.5-vl-tiny
TINY_MODELS+=,video-llava-tiny,qwen3-vl-tiny,qwen3-vl-moe-tiny,qwen3.5-tiny,internvl3-tiny
RESERVE_S=15  # the summary and the bundle, after the last step

die() { echo "error: $*" >&2; exit 2; }

# ---- settings: a mistake ends here, in one line, exit 2 ------------------------------------------------------
DEVICE=${DEVICE:-cuda}
SCOPE=${SCOPE:-full}
INSTALL=${INSTALL:-auto}
case "$DEVICE" in cuda|cpu) ;; *) die "DEVICE=$DEVICE: use cuda or cpu";; esac
case "$SCOPE" in full|smoke) ;; *) die "SCOPE=$SCOPE: use full or smoke";; esac
case "$INSTALL" in auto|0) ;; *) die "INSTALL=$INSTALL: use auto or 0";; esac
if [ "$DEVICE" = cuda ]; then default_deadline=540; default_jobs=4; else default_deadline=3600; default_jobs=1; fi
DEADLINE_S=${DEADLINE_S:-$default_deadline}
JOBS=${JOBS:-$default_jobs}
if ! [[ "$DEADLINE_S" =~ ^[0-9]+$ ]] || (( DEADLINE_S <= RESERVE_S )); then
  die "DEADLINE_S=$DEADLINE_S: give whole seconds above $RESERVE_S"
fi
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "JOBS=$JOBS: give a whole number of runs, 1 or more"
STEPS=${STEPS:-all}
if [ "$STEPS" != all ]; then
  IFS=, read -ra asked <<< "$STEPS"
  for name in "${asked[@]}"; do
    [ -n "${TITLE[$name]+x}" ] || die "STEPS: unknown step '$name'; the steps: ${STEP_NAMES[*]}"
  done
fi
if [ -z "${PYTHON:-}" ]; then PYTHON=$(command -v python || command -v python3) || die "no python on PATH; set PYTHON"; fi
command -v "$PYTHON" > /dev/null || die "PYTHON=$PYTHON: not found"
OUT=${OUT:-gpu-run-out}
if [ "${1:-}" != --step ]; then
  mkdir -p "$OUT" 2> /dev/null && [ -w "$OUT" ] || die "OUT=$OUT: cannot write there"
  OUT=$(cd "$OUT" && pwd)
  [ -z "$(ls -A "$OUT")" ] || [ -f "$OUT/summary.json" ] ||
    die "OUT=$OUT holds other files; give an empty folder (a previous run's 4 files are replaced)"
fi

# ---- what every step shares ------------------------------------------------------------------------------------
if [ -z "${GPU_RUN_DIR:-}" ]; then GPU_RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu-run.XXXXXX"); fi
SITE="$GPU_RUN_DIR/site"  # the carried wheels, unpacked, where pip cannot install them
export DEVICE SCOPE INSTALL DEADLINE_S JOBS PYTHON GPU_RUN_DIR OUT
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
helper() { "$PYTHON" "$ROOT/benchmarks/gpu_run.py" "$@"; }
ficoco() { "$PYTHON" -m ficoco_cli "$@"; }
check() { "$PYTHON" "$ROOT/benchmarks/check_report.py" "$@"; }
why() { printf '%s\n' "$*" > "$STEP_DIR/why"; }
add_why() { local line; line=$(tail -n1 "$STEP_DIR/why" 2> /dev/null); why "$line$*"; }

if [ "$DEVICE" = cuda ]; then
  DTYPE=fp16; BIG_DTYPE=bf16; RUNS=(--warmup 1 --repeat 3); NEW=8; QUANT_NEW=4
else  # a CPU computes in its fastest dtype; one timed run a row (the CPU figures are not what is checked)
  DTYPE=auto; BIG_DTYPE=auto; RUNS=(--warmup 0 --repeat 1); NEW=2; QUANT_NEW=2
fi

# profile_and_check NAME EXPECTED_VARIANTS PROFILE_ARGS...: one `ficoco profile` into NAME.json/.txt and its check;
# one line into checks.tsv (name, profile exit, check exit, rows, first problem).
profile_and_check() {
  local name=$1 expected=$2; shift 2
  local json="$STEP_DIR/$name.json" prc crc problem
  echo "ficoco profile $* --json $name.json" > "$STEP_DIR/$name.txt"
  ficoco profile --device "$DEVICE" "${RUNS[@]}" "$@" --json "$json" >> "$STEP_DIR/$name.txt" 2>&1
  prc=$?
  if [ -f "$json" ]; then
    check "$json" "$DEVICE" --expect "$expected" > "$STEP_DIR/$name.check.txt" 2>&1
    crc=$?
  else
    echo "no report written" > "$STEP_DIR/$name.check.txt"; crc=1
  fi
  # check_report.py ends with PASS, or FAIL: and one indented line per problem (a traceback ends otherwise)
  problem=""
  if [ "$crc" != 0 ]; then
    problem=$(sed -n '/^FAIL:/{n;p;q;}' "$STEP_DIR/$name.check.txt" | sed 's/^ *//')
    problem=${problem:-$(tail -n1 "$STEP_DIR/$name.check.txt")}
  fi
  [ "$prc" = 0 ] || problem="$(grep -m1 '^error' "$STEP_DIR/$name.txt" || tail -n1 "$STEP_DIR/$name.txt")"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$prc" "$crc" "$(helper rows "$json")" "$(tr '\t' ' ' <<< "${problem:0:300}")" \
    >> "$STEP_DIR/checks.tsv"
  printf '  %-28s profile exit %s, check_report %s%s\n' "$name" "$prc" "$([ "$crc" = 0 ] && echo PASS || echo FAIL)" \
    "${problem:+: ${problem:0:160}}"
}

# run_plan MODELS VARIANTS EXTRA...: the planner's keep groups (every variant at a keep it runs), JOBS at once.
run_plan() {
  local models=$1 variants=$2; shift 2
  local kind model keep hp names running=0
  helper plan --models "$models" --variants "$variants" > "$STEP_DIR/plan.tsv" || { why "the planner failed"; return 1; }
  while IFS=$'\t' read -r kind model keep hp names; do
    if [ "$kind" = refused ]; then printf '%s\t%s\t%s\n' "$model" "$keep" "$hp" >> "$STEP_DIR/refused.tsv"; continue; fi
    local args=(--model "$model" --variant "$names" --keep "$keep" "$@") name="$model-k$keep"
    [ "$hp" = - ] || { args+=(--hp "$hp"); name+="-${hp//[=,]/-}"; }
    profile_and_check "$name" "$names" "${args[@]}" &
    running=$((running + 1))
    if (( running >= JOBS )); then wait -n; running=$((running - 1)); fi
  done < "$STEP_DIR/plan.tsv"
  wait
}

# ---- the steps: each writes its one line to $STEP_DIR/why; exit 0 PASS, 1 FAIL, 3 SKIPPED ---------------------

step_environment() {
  if [ "$INSTALL" = 0 ]; then
    echo "INSTALL=0: nothing installed"; echo '{"carried": null, "installed": [], "kept": [], "how": "INSTALL=0"}' \
      > "$GPU_RUN_DIR/install.json"
  else
    helper install "$ROOT/.gpu-wheels" --record "$GPU_RUN_DIR/install.json" --site "$SITE" ||
      { why "installing the carried wheels failed"; return 1; }
  fi
  helper env --device "$DEVICE" --install "$GPU_RUN_DIR/install.json" --json "$STEP_DIR/environment.json" \
    --why "$STEP_DIR/why"
  local rc=$?
  cp "$STEP_DIR/environment.json" "$GPU_RUN_DIR/environment.json" 2> /dev/null
  return "$rc"
}

step_gpu-tests() {
  local not_ready files
  [ "$DEVICE:$SCOPE" != cpu:smoke ] ||
    { why "smoke scope on a CPU: the suite itself collects the gpu tests and skips them (SCOPE=full runs pytest -m gpu)"; return 3; }
  not_ready=$(helper ready pytest --env "$GPU_RUN_DIR/environment.json") || { why "$not_ready"; return 3; }
  mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
  FICOCO_GPU_TESTS=1 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -rs --junitxml "$STEP_DIR/junit.xml" \
    "${files[@]}" > "$STEP_DIR/pytest.txt" 2>&1
  local rc=$?
  grep -E '^(SKIPPED|FAILED|ERROR)' "$STEP_DIR/pytest.txt" | head -n 12 | sed 's/^/  /'
  local line
  line=$(grep -E '^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|skipped|error)' "$STEP_DIR/pytest.txt" \
         | tail -n1 | tr -d '=' | sed 's/^ *//;s/ *$//')
  if [ "$rc" != 0 ]; then why "pytest exit $rc: ${line:-see pytest.txt}"; return 1; fi
  if [ "$DEVICE" = cpu ]; then
    if grep -qE '[0-9]+ passed' <<< "$line"; then why "a gpu test ran on a CPU: $line"; return 1; fi
    why "${#files[@]} files collected; $line (no CUDA here: each gpu test skips with its reason)"; return 0
  fi
  if grep -q skipped <<< "$line"; then why "$line: a skipped GPU test ran nothing (reasons in pytest.txt)"; return 1; fi
  # The reads (Triton's two-loop kernels, torch's blocks) timed beside the model's SDPA at two real shapes.
  "$PYTHON" benchmarks/time_reads.py --device cuda --json "$STEP_DIR/reads.json" 2>&1 | tee "$STEP_DIR/reads.txt"
  why "$line in ${#files[@]} files; reads timed beside SDPA in reads.json"
}

step_tiny-methods() {
  local models=$TINY_MODELS variants=$ALL_VARIANTS
  # smoke: one planned run (PruMerge+ on LLaVA) and one refusal (PruMerge+ on Qwen2-VL: nothing runs)
  [ "$SCOPE" = smoke ] && { models=llava-tiny,qwen2-vl-tiny; variants=vanilla,prumerge; }
  run_plan "$models" "$variants" --dtype "$DTYPE"
  helper tally "$STEP_DIR" --why "$STEP_DIR/why"
}

step_tiny-quant() {
  # Not a Qwen tiny family: their towers' 96-wide MLPs are no multiple of NF4's 64-weight blocks, which
  # bitsandbytes' CPU backend refuses at the first int4 forward (so the same command could not run on a CPU).
  local not_ready models=llava-tiny,internvl3-tiny variants=$MAIN_VARIANTS batches=1,2
  not_ready=$(helper ready quant --device "$DEVICE" --env "$GPU_RUN_DIR/environment.json") || { why "int8/int4 cannot run: $not_ready"; return 3; }
  local quants=int8,int4
  [ "$SCOPE" = smoke ] && { models=llava-tiny; variants=vanilla,v; batches=1; quants=int4; }
  JOBS=1 run_plan "$models" "$variants" --quant "$quants" --batch "$batches" --new-tokens "$QUANT_NEW"
  if [ "$SCOPE" != smoke ]; then
    # A local checkpoint (save_pretrained, then --weights): int8/int4 quantized by transformers as it loads.
    "$PYTHON" -c 'import sys, ficoco
ficoco.build_model("llava-tiny", dtype="fp32", check_memory=False).save_pretrained(sys.argv[1])' \
      "$GPU_RUN_DIR/checkpoint"
    # Its config.json has the family's defaults, not llava-tiny's reducing layers (V from 12 of 6 vision layers).
    profile_and_check checkpoint vanilla,v,l --model "$GPU_RUN_DIR/checkpoint" --weights "$GPU_RUN_DIR/checkpoint" \
      --variant vanilla,v,l --keep 16 --quant fp16,int8,int4 --set ficoco.first_reducing_layer.v=2 \
      --set ficoco.first_reducing_layer.l=1
  fi
  helper tally "$STEP_DIR" --why "$STEP_DIR/why"
}

step_main-job() {
  local not_ready quants=fp16,int8,int4 model=llava-1.5-7b budget=1.5 batches=1,8 variants=vanilla,v,fastv,visionzip,divprune
  local dtype=fp16 note=""
  if [ "$DEVICE" = cpu ]; then model=llava-tiny; budget=6e-05; dtype=auto; batches=1,2; fi  # the tiny stand-in
  [ "$SCOPE" = smoke ] && batches=1
  if ! not_ready=$(helper ready quant --device "$DEVICE" --env "$GPU_RUN_DIR/environment.json") || [ "$SCOPE" = smoke ]; then
    quants=fp16; note="; int8/int4 left out: ${not_ready:-smoke scope}"
  fi
  # FiCoCo-L's uniform schedule cannot reach 1.5 TFLOPs on LLaVA-1.5-7B (cheapest 1.85); oneshot from layer 2 can.
  # smoke: the L run alone (its flags are the others' and --shape, --first-layer)
  [ "$SCOPE" = smoke ] || profile_and_check main "$variants" --model "$model" --variant "$variants" \
    --tflops "$budget" --quant "$quants" --batch "$batches" --dtype "$dtype"
  profile_and_check main-l l --model "$model" --variant l --tflops "$budget" --shape oneshot --first-layer 2 \
    --quant "$quants" --batch "$batches" --dtype "$dtype"
  helper tally "$STEP_DIR" --why "$STEP_DIR/why"
  local rc=$?
  add_why "$note"
  return "$rc"
}

# big_model MODEL TINY KEEP EXTRA...: a 2026 backbone at its real shapes on cuda; its tiny profile on a CPU.
big_model() {
  local model=$1 tiny=$2 keep=$3; shift 3
  local variants=$MAIN_VARIANTS batches=1,8
  if [ "$DEVICE" = cpu ]; then
    if [ "$SCOPE" = smoke ]; then
      [ "$model" = qwen3-vl-8b ] ||
        { why "smoke scope: on a CPU this is qwen3-vl-8b's command on another tiny family (SCOPE=full runs it)"; return 3; }
      variants=vanilla,v
    fi
    run_plan "$tiny" "$variants" --batch 1 --new-tokens "$NEW" --dtype "$BIG_DTYPE"
  else
    profile_and_check "$model" "$variants" --model "$model" --variant "$variants" --keep "$keep" --batch "$batches" \
      --new-tokens "$NEW" --dtype "$BIG_DTYPE" "$@"
  fi
  helper tally "$STEP_DIR" --why "$STEP_DIR/why"
}
step_qwen3-vl-8b() { big_model qwen3-vl-8b qwen3-vl-tiny 144; }
step_qwen3.5-0.8b() { big_model qwen3.5-0.8b qwen3.5-tiny 144 --hp layer=4; }
step_internvl3-8b() { big_model internvl3-8b internvl3-tiny 64 --image-size 448x448; }

step_device-map() {
  local limits=cuda:0=1200KiB,cpu=1GiB variants=vanilla,v,l  # llava-tiny: about 2 MB of fp32 weights
  local args=(--device-map auto --max-memory "$limits")
  [ "$DEVICE" = cpu ] && args=(--device-map cpu-offload --max-memory cpu=900KiB)
  [ "$SCOPE" = smoke ] && variants=vanilla,l
  profile_and_check device-map "$variants" --model llava-tiny --variant "$variants" --keep 16 --dtype fp32 "${args[@]}"
  helper tally "$STEP_DIR" --why "$STEP_DIR/why" || return 1
  local places
  places=$("$PYTHON" -c 'import json,sys; r=json.load(open(sys.argv[1]))["rows"][0]["device_map"]
print(" ".join(f"{k}:{v}" for k, v in r["modules_per_device"].items()))' "$STEP_DIR/device-map.json") ||
    { why "the report holds no device map"; return 1; }
  echo "  modules per place: $places"
  [ "$(wc -w <<< "$places")" -ge 2 ] || { why "the map put every module in one place: $places"; return 1; }
  add_why "; modules per place: $places"
}

step_lmms-eval() {
  local not_ready
  [ "$SCOPE" = smoke ] && { why "smoke scope: lmms-eval's imports alone take ~15 s on 2 cores (SCOPE=full runs it)"; return 3; }
  not_ready=$(helper ready lmms --env "$GPU_RUN_DIR/environment.json") || { why "$not_ready"; return 3; }
  helper lmms --device "$DEVICE" --out "$STEP_DIR/lmms" --why "$STEP_DIR/why"
}

step_qwen3-vl-30b-a3b() {
  [ "$DEVICE" = cpu ] && { why "needs a GPU with ~65 GB free (61 GB of bf16 weights); its tiny MoE ran in tiny-methods"; return 3; }
  local fits
  fits=$(helper fits qwen3-vl-30b-a3b --margin-gb 4); local rc=$?
  echo "$fits"
  [ "$rc" = 0 ] || { why "does not fit: $fits"; return 3; }
  profile_and_check qwen3-vl-30b-a3b "$MAIN_VARIANTS" --model qwen3-vl-30b-a3b --variant "$MAIN_VARIANTS" --keep 144 \
    --batch 1 --new-tokens "$NEW" --dtype bf16
  helper tally "$STEP_DIR" --why "$STEP_DIR/why"
}

# ---- one step, in its own process (so that the deadline can stop it and what it started) --------------------
if [ "${1:-}" = --step ]; then
  STEP_DIR=$2
  "step_$3"
  exit $?
fi

# ---- the run ---------------------------------------------------------------------------------------------------
estimate_of() {
  local needs=""
  case $1 in tiny-quant) needs=quant ;; gpu-tests) needs=pytest ;; lmms-eval) needs=lmms ;; esac
  # A step whose tools the environment step did not find only says so: it takes no time.
  if [ -n "$needs" ] && [ -f "$GPU_RUN_DIR/environment.json" ] &&
     ! helper ready "$needs" --env "$GPU_RUN_DIR/environment.json" > /dev/null; then echo 0
  elif [ "$DEVICE" = cuda ]; then echo "${EST_CUDA[$1]}"
  elif [ "$SCOPE" = smoke ]; then echo "${EST_SMOKE[$1]}"
  else echo "${EST_CPU[$1]}"; fi
}

run_all() {
  local started=$SECONDS index=0 name
  echo "gpu_run.sh: DEVICE=$DEVICE SCOPE=$SCOPE DEADLINE_S=$DEADLINE_S JOBS=$JOBS STEPS=$STEPS PYTHON=$PYTHON"
  echo "tree $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2> /dev/null || echo 'not a git checkout')); OUT=$OUT"
  : > "$GPU_RUN_DIR/steps.jsonl"
  mkdir -p "$GPU_RUN_DIR/reports"
  for name in "${STEP_NAMES[@]}"; do
    index=$((index + 1))
    local dir estimate left status why_line began rc
    dir="$GPU_RUN_DIR/reports/$(printf '%02d' "$index")-$name"
    mkdir -p "$dir"
    estimate=$(estimate_of "$name")
    left=$((DEADLINE_S - RESERVE_S - (SECONDS - started)))
    (( left > 0 )) || left=0
    printf '\n=== [%d/%d] %s: %s\n--- expect: %s\n--- estimate: ~%d s; %d s left before the deadline\n' \
      "$index" "${#STEP_NAMES[@]}" "$name" "${TITLE[$name]}" "${EXPECT[$name]}" "$estimate" "$left"
    began=$SECONDS
    # The environment step always runs: it installs what was carried, and the others read what it found.
    if [ "$STEPS" != all ] && [ "$name" != environment ] && [[ ",$STEPS," != *",$name,"* ]]; then
      status=SKIPPED; why_line="not asked for (STEPS=$STEPS)"
    elif (( estimate > left || left < 1 )); then
      status=SKIPPED; why_line="needs ~$estimate s, $left s left before the deadline (DEADLINE_S=$DEADLINE_S)"
    else
      timeout -k 10 "$left" bash "$SELF" --step "$dir" "$name" > "$dir/log.txt" 2>&1
      rc=$?
      why_line=$(tail -n1 "$dir/why" 2> /dev/null)
      case $rc in
        0) status=PASS ;;
        3) status=SKIPPED ;;
        124|137) status=FAIL; why_line="stopped at the deadline after $((SECONDS - began)) s (estimated ~$estimate s)" ;;
        *) status=FAIL; why_line=${why_line:-"exit $rc; see $name/log.txt"} ;;
      esac
      grep -E '^  ' "$dir/log.txt" | head -n 40
      if [ "$status" = FAIL ]; then  # the step's own log, else the output of what it ran last
        local last="$dir/log.txt"
        [ -s "$last" ] || last=$(find "$dir" -name '*.txt' -printf '%T@ %p\n' | sort -n | tail -n1 | cut -d' ' -f2-)
        echo "--- last lines of ${last#"$GPU_RUN_DIR"/}:"; tail -n 12 "$last" 2> /dev/null
      fi
    fi
    printf '%s %s (%d s): %s\n' "$status" "$name" "$((SECONDS - began))" "$why_line"
    helper record --file "$GPU_RUN_DIR/steps.jsonl" --name "$name" --title "${TITLE[$name]}" --status "$status" \
      --why "$why_line" --expect "${EXPECT[$name]}" --seconds "$((SECONDS - began))" --estimate "$estimate"
  done
  echo
  tar -czf "$OUT/reports.tar.gz" -C "$GPU_RUN_DIR" reports
  helper summary --steps "$GPU_RUN_DIR/steps.jsonl" --env "$GPU_RUN_DIR/environment.json" --out "$OUT" \
    --device "$DEVICE" --scope "$SCOPE" --deadline "$DEADLINE_S" --wall "$((SECONDS - started))" \
    --files summary.txt,summary.json,gpu_run.log,reports.tar.gz
  ! grep -q '"status": "FAIL"' "$GPU_RUN_DIR/steps.jsonl"
}

rm -f "$OUT/summary.txt" "$OUT/summary.json" "$OUT/gpu_run.log" "$OUT/reports.tar.gz"
run_all 2>&1 | tee "$OUT/gpu_run.log"
status=${PIPESTATUS[0]}
[ -n "${GPU_RUN_KEEP:-}" ] || rm -rf "$GPU_RUN_DIR"
exit "$status"
