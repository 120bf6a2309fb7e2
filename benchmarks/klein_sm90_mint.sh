#!/usr/bin/env bash
# The klein sm_90 store: on one H200, mint the 1024x1024 transformer in bf16 and fp8 (each with
# the example's lanes) and the bf16 VAE decoder into a copy of the example, then archive the
# store and the trace cache (a later call plans warm and serves without minting).
#
#   benchmarks/klein_sm90_mint.sh WORK OUT [SECONDS]
#
# The copy's Cgfile keeps only those targets (layouts bf16 and fp8, shape 1024x1024): a key names
# its own target's axes, so the keys are the example's own. A VAE decoder already in
# gpu_sm90_store_vae.tgz, or anything in this script's own earlier gpu_sm90_store_klein.tgz, is
# fresh under its key and not minted again. The mint runs at most
# SECONDS (default 520); whatever it admitted by then is archived. LANES (TOML lines, e.g.
# LANES='qk-norm = ["unfused", "fused"]') are added to the family's lanes table first.
set -uo pipefail
work=$1
out=$2
limit=${3:-520}
here=$(cd "$(dirname "$0")/.." && pwd)
ws=$work/ws
rm -rf "$ws"
mkdir -p "$work" "$out"
cp -r "$here/examples/flux2_klein" "$ws"
rm -rf "$ws/.cgbuild" "$ws/__pycache__"
mkdir -p "$ws/.cgbuild"
LANES="${LANES:-}" PYTHONPATH="$here/benchmarks${PYTHONPATH:+:$PYTHONPATH}" python3 - "$ws/Cgfile" <<'EOF'
import os
import sys
from pathlib import Path

from targets import add_lanes

path = sys.argv[1]
if os.environ["LANES"]:
    add_lanes(Path(path), "flux2-klein", os.environ["LANES"])
text = open(path).read()
text = text.replace('layouts = ["bf16", "int8", "fp8"]', 'layouts = ["bf16", "fp8"]', 1)
text = text.replace('shapes = ["768x768", "1024x1024"]', 'shapes = ["1024x1024"]')
open(path, "w").write(text)
EOF
for archive in gpu_sm90_store_vae.tgz gpu_sm90_store_klein.tgz; do  # what earlier calls sealed
  [ -f "$here/benchmarks/results/$archive" ] && tar -xzf "$here/benchmarks/results/$archive" -C "$ws/.cgbuild"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.csv"
start=$(date +%s)
timeout "$limit" python3 -m cgbuild.cli -C "$ws" mint //flux2-klein:sm_90 -j 3 --json \
  > "$out/mint.json" 2> "$out/mint.err"
echo "mint exit $? after $(( $(date +%s) - start )) s"
tail -c 1500 "$out/mint.err"
python3 -m cgbuild.cli -C "$ws" plan //flux2-klein:sm_90 --json > "$out/plan.json"
tar -czf "$out/gpu_sm90_store_klein.tgz" -C "$ws/.cgbuild" store $(cd "$ws/.cgbuild" && ls traces.* 2>/dev/null)
ls -la "$out"
