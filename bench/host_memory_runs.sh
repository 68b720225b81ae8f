#!/bin/bash
# The host_memory unit in whole runs: 2-epoch cifar10 runs with scaling.reuse_host_memory false and true,
# interleaved, N pairs (default 2), one line each in $OUT (default /tmp/host_memory_runs.txt): training seconds
# to the end (elapsed_s of the last report), images/s per report, the final top-1 (the same on both: the CPU run is
# deterministic). Needs ../shared/data/cifar10; nothing else should run beside it. About 4 minutes a run here.
#   bash bench/host_memory_runs.sh [pairs]
set -euo pipefail
DATA=${DATA:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data/cifar10}
OUT=${OUT:-/tmp/host_memory_runs.txt}
PAIRS=${1:-2}
for i in $(seq 1 "$PAIRS"); do for m in false true; do
  d=${TMPDIR:-/tmp}/host_memory_${m}_$i; rm -rf $d
  lightray train --config cifar10 --data "$DATA" --storage $d --name a --schedule.epochs=2 --scaling.reuse_host_memory=$m > $d.log 2>&1
  python -c "
import json
rs=[json.loads(l) for l in open('$d/a/metrics.jsonl')]
tr=[r for r in rs if 'images_per_s' in r]
print('$m', $i, 'elapsed_s', round(tr[-1]['elapsed_s'],1), 'ips', [round(r['images_per_s']) for r in tr], 'top1', [r.get('val_top1') for r in rs if 'val_top1' in r][-1:])
" >> "$OUT"
done; done
