#!/usr/bin/env bash
# The one-GPU suite: one command, under 10 minutes on one GPU with 16 cores, the headline figures first (a machine
# lost half-way still gives them). Steps, each under its own limit (bench/step_limit.py: at the limit, or when the
# step exits, every process it started is ended, Ray's cluster and GPU workers included), raw logs kept, one
# summary line per step at the end, then one JSON line on stdout:
#   env         versions, nvidia-smi, torch.cuda device properties, nvJPEG decode of 1 and 256 JPEGs timed
#   tput128     synthetic ResNet-50 img/s at 128 px: lightray vs plain PyTorch done right (bf16, channels_last,
#   tput224     cudnn.benchmark, both eager: the same compile setting)  -- and at 224 px
#   e2e         the whole stack from JPEGs at 128 px vs synthetic on the same model (bench/gpu_e2e.py)
#   resume      a smoke run stopped and resumed on the GPU against an uninterrupted one (bench/gpu_resume.py)
#   pipeline    device decode and device augmentation vs the CPU path, per core (bench/pipeline.py --quick)
#   comm        the compression's own compute per comm mode at ResNet-50 size on the GPU (bench/comm.py)
#   sync        the steady-state step under CUDA's sync debug mode (tests/test_step_sync.py)
#
#   bash bench/gpu_suite.sh             # on the GPU machine, from anywhere
#   bash bench/gpu_suite.sh --dry-run   # tiny sizes on the CPU: the same entry points; CUDA-only steps say skipped
#
# Logs: $OUT_DIR, else $OUT (the device tool brings it back), else bench/gpu_suite_logs/<date>. Exit status 0
# when every step passed (dry run: passed or skipped as expected), 1 otherwise.
set -u  # no set -e: a failing step must never stop the others
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument '$a'; expected --dry-run or nothing" >&2; exit 2 ;;
  esac
done
OUT_DIR="${OUT_DIR:-${OUT:-bench/gpu_suite_logs/$(date +%Y%m%d-%H%M%S)}}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
# The GPU machine has no Ray, pydantic or lightray (the package is the folder app/): the bundle that travels with
# the checkout (python -m bench.gpu_bundle) is installed from its own wheels alone, then the imports checked.
BUNDLE="${GPU_BUNDLE:-bench/gpu_bundle}"
if ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
  SITE="${GPU_SITE:-$PWD/.gpu_site}"
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$BUNDLE"/*.whl >"$OUT_DIR/install.log" 2>&1; then
    echo "gpu_suite: installing the bundle $BUNDLE failed; see $OUT_DIR/install.log" >&2
    exit 1
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
if ! "$PY" -c "import lightray, ray, torch; print(f'gpu_suite: ray {ray.__version__}, torch {torch.__version__}, \
lightray from {lightray.__path__[0]}')" >&2; then
  echo "gpu_suite: lightray, Ray or torch does not import; build the bundle here: python -m bench.gpu_bundle" >&2
  exit 1
fi
STEPS=(env tput128 tput224 e2e resume pipeline comm sync)  # the order they run in: the headline first
SYNC_TEST=tests/test_step_sync.py::test_steady_state_steps_never_synchronise_with_the_host

if [ "$DRY" = 1 ]; then
  # Generous limits: the dry run checks the scripts, and this may be a shared 2-core machine.
  declare -A BUDGET=([env]=60 [tput128]=90 [tput224]=90 [e2e]=240 [pipeline]=240 [comm]=120 [resume]=60 [sync]=90)
  ENV_ARGS=(--dry-run)
  TPUT_ARGS=(--cpu-dry-run --arch resnet_tiny --variants plain,plain_bf16,lightray)
  TPUT128=("${TPUT_ARGS[@]}"); TPUT224=("${TPUT_ARGS[@]}")
  E2E_ARGS=(--dry-run)  # all three tiny phases: the dry run checks the per-phase figures the GPU run's one phase gives
  # The sizes of tests/test_pipeline_bench.py's checks, which read this step's log: one bench run for both.
  PIPE_ARGS=(--cpu-dry-run --images 48 --sizes 32 --workers 2 --epochs 2)
  COMM_ARGS=(--overhead-only --device cpu --overhead-batch 1 --overhead-reps 1)
  RESUME_ARGS=(--dry-run)
else
  # Seconds per step, sized for a cold machine (nothing cached, Ray and torch imported for the first time); they
  # sum to 535, so the suite with the bundle's install, Python's start-ups and the summary stays within 10 minutes.
  # Not yet checked on a GPU: the e2e and resume limits are this machine's start-up figures scaled, not measured.
  # tput: eager (compile would cost about a minute per size and variant); 10 warm-up steps cover cuDNN's search.
  # e2e: 6000 JPEGs = 23 steps of 256 at 128 px, enough report windows after the compile window; Ray's start, the
  # prepare, the worker group and the cold compiles come first (130 s was too short for them).
  # resume: four smoke drivers one after another (two uninterrupted, whose spread judges the resumed one), each
  # starting Ray and a worker group (65 s was too short for three).
  declare -A BUDGET=([env]=25 [tput128]=40 [tput224]=55 [e2e]=170 [resume]=140 [pipeline]=50 [comm]=25 [sync]=30)
  ENV_ARGS=(--batch 256)
  TPUT_ARGS=(--arch resnet50 --batch 256 --warmup 10 --steps 20 --windows 3 --variants plain_bf16,lightray)
  TPUT128=("${TPUT_ARGS[@]}" --res 128); TPUT224=("${TPUT_ARGS[@]}" --res 224)
  E2E_ARGS=(--phases 128 --images 6000 --val-images 256)
  PIPE_ARGS=(--quick)
  COMM_ARGS=(--overhead-only --device cuda --overhead-batch 64)
  RESUME_ARGS=()
fi

run_step() {  # name command...: the step under its budget, stdout and stderr into its log
  local name="$1"; shift
  local t0; t0=$(date +%s)
  echo "[gpu_suite $(date +%H:%M:%S)] $name (limit ${BUDGET[$name]} s): $*" >&2
  # Not `timeout -k`: Ray's driver leaves the step's process group and Ray's processes start sessions of their own,
  # so a step killed at its limit kept its cluster (and the GPU) under the next. 124 at the limit, as timeout.
  "$PY" -m bench.step_limit "${BUDGET[$name]}" "$OUT_DIR/$name.log" -- "$@"
  echo $? >"$OUT_DIR/$name.rc"
  echo $(( $(date +%s) - t0 )) >"$OUT_DIR/$name.s"
}

run_step env "$PY" -m bench.gpu_env "${ENV_ARGS[@]}"
run_step tput128 "$PY" -m bench.gpu_throughput "${TPUT128[@]}"
run_step tput224 "$PY" -m bench.gpu_throughput "${TPUT224[@]}"
run_step e2e "$PY" -m bench.gpu_e2e "${E2E_ARGS[@]}"
run_step resume "$PY" -m bench.gpu_resume "${RESUME_ARGS[@]}"
run_step pipeline "$PY" -m bench.pipeline "${PIPE_ARGS[@]}"
run_step comm "$PY" -m bench.comm "${COMM_ARGS[@]}"
# -rs: the skip reason reaches the log; -p no:cacheprovider: no .pytest_cache written into the tree.
run_step sync "$PY" -m pytest -q -rs -p no:cacheprovider "$SYNC_TEST"

budgets=""
for s in "${STEPS[@]}"; do budgets="$budgets $s=${BUDGET[$s]}"; done
"$PY" -m bench.gpu_suite_summary "$OUT_DIR" "$DRY" $budgets
