#!/usr/bin/env bash
# One-GPU speed check (sized for one H200; under 5 minutes):
#   1. ResNet-50 training images/s on synthetic data: plain fp32 vs lightray (bf16 + channels_last +
#      cudnn.benchmark + fused SGD), with and without torch.compile  (bench/gpu_throughput.py)
#   2. the data pipeline's delivered images/s: `python -m bench.pipeline --quick`
# and prints ONE JSON line {"bench": "gpu_check", "figures", "ratios", "machine", "parts"}.
#
#   bash bench/gpu_check.sh                 # on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --cpu-dry-run   # tiny sizes on CPU: checks the script end to end
#
# Each part runs under its own time limit; a part that fails or times out is reported in "parts" with
# its exit status and the tail of its stderr, and the others still run.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
DRY=0
for a in "$@"; do
  case "$a" in
    --cpu-dry-run) DRY=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$a'; expected --cpu-dry-run or nothing" >&2; exit 2 ;;
  esac
done
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [ "$DRY" = 1 ]; then
  # The smallest model and pipeline that run every part: the dry run checks the script, not the speed.
  THROUGHPUT_ARGS=(--cpu-dry-run --arch resnet_tiny)
  PIPE_ARGS=(--quick --cpu-dry-run --images 48 --sizes 32 --workers 2 --epochs 2)
  LIMIT_T=300; LIMIT_P=120
else
  # 15 warm-up steps cover compile (about a minute for ResNet-50) and cuDNN's search; 3 x 30 timed steps.
  THROUGHPUT_ARGS=(--arch resnet50 --batch 256 --res 224 --warmup 15 --steps 30 --windows 3)
  PIPE_ARGS=(--quick)
  LIMIT_T=270; LIMIT_P=60
fi

run_part() {  # name limit_s command...
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
  echo $? >"$TMP/$name.rc"
  echo $(( $(date +%s) - t0 )) >"$TMP/$name.s"
}

run_part throughput "$LIMIT_T" "$PY" -m bench.gpu_throughput "${THROUGHPUT_ARGS[@]}"
run_part pipeline "$LIMIT_P" "$PY" -m bench.pipeline "${PIPE_ARGS[@]}"

"$PY" - "$TMP" "$DRY" <<'PYEOF'
import json, pathlib, sys
tmp, dry = pathlib.Path(sys.argv[1]), sys.argv[2] == "1"
out = {"bench": "gpu_check", "figures": {}, "ratios": {}, "machine": {}, "parts": {}}
for name in ("throughput", "pipeline"):
    rc = int((tmp / f"{name}.rc").read_text())
    part = {"rc": rc, "seconds": int((tmp / f"{name}.s").read_text())}
    lines = [ln for ln in (tmp / f"{name}.out").read_text().splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        res = json.loads(lines[-1])
        prefix = "" if name == "throughput" else f"{name}_"
        out["figures"].update({prefix + k: v for k, v in res.get("figures", {}).items()})
        out["ratios"].update({prefix + k: v for k, v in res.get("ratios", {}).items()})
        if name == "throughput":
            out["machine"] = res.get("machine", {})
        part["status"] = "ok"
    else:
        part["status"] = "timed out" if rc in (124, 137) else "failed"
        part["stderr_tail"] = (tmp / f"{name}.err").read_text()[-1500:]
    out["parts"][name] = part
out["machine"]["dry_run"] = dry
out["machine"]["command"] = "bash bench/gpu_check.sh" + (" --cpu-dry-run" if dry else "")
print(json.dumps(out))
sys.exit(0 if out["parts"]["throughput"].get("status") == "ok" else 1)
PYEOF
