#!/usr/bin/env bash
# One prepared GPU check of the Triton kernels and the engine, in under 9 minutes on one H200:
#   1. tests/test_kernels.py with the kernels compiled for CUDA (not the interpreter), bf16 included;
#   2. the engine on CUDA (tests/test_gpu_engine.py: the CPU's greedy tokens through pinned buffers; the MoE
#      grouped-GEMM path of tests/test_moe.py);
#   3. scripts/gpu_bench.py: each kernel against its torch reference, and a Qwen3-0.6B-shaped decode step.
# Installs nothing: torch, triton and transformers must already be there. Run from anywhere:
#   bash scripts/gpu_check.sh            # logs and gpu_report.md go to $OUT when it is set
# Exit status: 0 when both parts succeed, else the first failing part's status.

set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # compiled kernels only: the point of this run
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" - <<'EOF' || { echo "no usable CUDA torch/triton here"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name()}")
EOF

status=0

# First compiles dominate: ~40 kernel variants at a few seconds each, then the tests themselves are fast.
echo "== tests/test_kernels.py (compiled)"
timeout 240 "$PYTHON" -m pytest tests/test_kernels.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT_DIR/kernel_tests.txt"
rc=${PIPESTATUS[0]}
echo "tests exit status: $rc"
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

echo "== the engine on CUDA"
timeout 90 "$PYTHON" -m pytest tests/test_gpu_engine.py tests/test_moe.py -k cuda -q -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT_DIR/engine_tests.txt"
rc=${PIPESTATUS[0]}
echo "engine tests exit status: $rc"
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

echo "== scripts/gpu_bench.py"
timeout 200 "$PYTHON" scripts/gpu_bench.py --out "$OUT_DIR/gpu_report.md" 2>&1 | tee "$OUT_DIR/gpu_bench.txt"
rc=${PIPESTATUS[0]}
echo "bench exit status: $rc"
[ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

echo "== done (status $status); logs and report in $OUT_DIR"
exit "$status"
