#!/usr/bin/env bash
# The whole stack on one GPU machine, offline, under 8 minutes (sized for one H200):
#   ~20k generated JPEGs (about 500x375, 100 classes) -> prepare -> `python app/run.py` (Ray Data,
#   TorchTrainer, ResNet-50 bf16 + channels_last + compile) for one epoch in each of the 128/224/288 px
#   phases, then the same model on synthetic data already on the device (bench/gpu_e2e.py). JPEG phases run
#   with data.decode_on=auto (CPU tasks vs nvJPEG on the GPU, timed at start); the line says which won.
# Prints ONE JSON line: per phase end-to-end img/s, synthetic img/s, their ratio, data-wait fraction, GPU
# utilisation, peak GPU memory, and what starved a phase below 0.9 of synthetic.
#
#   bash bench/gpu_e2e.sh              # on the GPU machine, from anywhere
#   bash bench/gpu_e2e.sh --dry-run    # tiny sizes on CPU: the same entry points, checks the script
#   bash bench/gpu_e2e.sh --images 8000 --raw-max 128   # any bench/gpu_e2e.py option passes through
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
for a in "$@"; do
  case "$a" in -h|--help) sed -n '2,12p' "$0"; exit 0 ;; esac
done
export RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
# 470 s: the whole check stays under 8 minutes with Python's start and the cleanup.
exec timeout 470 "$PY" -m bench.gpu_e2e "$@"
