#!/usr/bin/env bash
# FP8 against bfloat16 on a GPU: one prepared run of policy_speed.py.
#
# Run from the repository root on a machine with an NVIDIA GPU of compute
# capability 8.9 or above (Ada, Hopper, Blackwell) and a CUDA build of JAX:
#
#   bash benchmarks/gpu_fp8.sh [OUT_DIR]      # default OUT_DIR: benchmarks/results/gpu
#
# It prints `jaxmp doctor` (does the GPU run FP8 natively?), then times the
# guarded train step of the demo model under float32, bfloat16, float16 and
# FP8 (benchmarks/policy_speed.py, its default size) and writes
# OUT_DIR/policy_speed.{md,json}; the FP8 step time as a ratio to bfloat16 is
# the last line, and `time_ratio_vs_bfloat16` in the JSON. Extra arguments
# after OUT_DIR go to policy_speed.py (e.g. --rounds 20).
set -euo pipefail
PYTHON=${PYTHON:-python}
OUT=${1:-benchmarks/results/gpu}
shift || true
"$PYTHON" -m jaxmp doctor
"$PYTHON" benchmarks/policy_speed.py --out "$OUT" "$@"
"$PYTHON" - "$OUT/policy_speed.json" <<'PY'
import json, sys
results = json.load(open(sys.argv[1]))
fp8 = results["policies"]["mixed_fp8"]
print(f"{results['machine']['device_kind']}: FP8 step time vs bfloat16: "
      f"{fp8['time_ratio_vs_bfloat16']:.3f}x")
PY
