#!/usr/bin/env bash
# The GPU checks, in a few minutes, on a machine with an NVIDIA GPU:
#   bash scripts/test_gpu.sh [--quick]
# 1. the `gpu`-marked tests: engine and trainer on CUDA in float32 and bf16 with their
#    log-prob agreement, every engine step tensor on the GPU, a LoRA update, FSDP2 trainer
#    ranks over NCCL on the GPUs present;
# 2. the `gpu and vllm` tests in .venv-vllm (vLLM's GPU wheel), where it is installed;
# 3. a 20-step experiment=rg_smol run (SmolLM2-135M-Instruct) on the GPU;
# 4. bench.precision --device cuda: engine/trainer log-prob agreement of every precision;
# 5. bench.gpu: the torch engine's tokens/s, the trainer's tokens/s and share of bf16 peak.
# Each step's output goes to runs/test_gpu/<step>.log; a summary ends it; the exit status is
# 1 if any step failed. Without a GPU it says so in one line and exits 0.
#
# Set-up: scripts/setup.sh (torch's CUDA build when nvidia-smi finds a GPU) and, for step 2,
# scripts/setup_vllm.sh (the vllm wheel). POLYRL_PYTHON=<python> skips both and uses that
# interpreter as it is (a machine with no network whose Python already has CUDA torch and the
# project's dependencies); step 2 then runs only if that interpreter imports vllm.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test_gpu: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to run"
  exit 0
fi

quick=()
[ "${1:-}" = "--quick" ] && quick=(--quick)
out=${TEST_GPU_OUT:-runs/test_gpu}
mkdir -p "$out"

if [ -n "${POLYRL_PYTHON:-}" ]; then
  py=$POLYRL_PYTHON
  vllm_py=$py
else
  bash scripts/setup.sh || exit 1
  py=.venv/bin/python
  vllm_py=.venv-vllm/bin/python
  bash scripts/setup_vllm.sh || echo "test_gpu: scripts/setup_vllm.sh failed; the vLLM step will be skipped"
fi
export PYTHONUNBUFFERED=1

names=()
results=()
run() {  # run NAME COMMAND...: its output to the terminal and $out/NAME.log
  local name=$1 started status
  shift
  echo "=== test_gpu: $name: $*"
  started=$(date +%s)
  "$@" 2>&1 | tee "$out/$name.log"
  status=${PIPESTATUS[0]}
  names+=("$name")
  results+=("$(printf '%-10s exit %-3s %4ss' "$name" "$status" "$(($(date +%s) - started))")")
  return 0
}

"$py" - <<'EOF' 2>&1 | tee "$out/device.log"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
      + f"; bf16: {torch.cuda.is_bf16_supported()}")
EOF

# Third-party deprecations from another torch/transformers than .venv's are not this
# project's failures here; every other warning still fails a test, as in the main suite.
# Only the files that hold gpu tests are collected (the others may import what is not installed).
mapfile -t gpu_files < <(grep -rl "pytest.mark.gpu" tests --include="test_*.py" | sort)
run tests "$py" -m pytest -m "gpu and not vllm" "${gpu_files[@]}" -q -p no:cacheprovider \
  -W "default::DeprecationWarning" -W "default::FutureWarning"
if "$vllm_py" -c "import vllm" >/dev/null 2>&1; then
  run vllm "$vllm_py" -m pytest -m "gpu and vllm" "${gpu_files[@]}" -q -p no:cacheprovider
else
  echo "=== test_gpu: vllm: skipped: $vllm_py cannot import vllm (scripts/setup_vllm.sh installs it)"
  names+=(vllm)
  results+=("$(printf '%-10s skipped: vLLM is not installed' vllm)")
fi
run rg_smol "$py" -m orchestrator experiment=rg_smol pipeline.num_steps=20 eval.every=10 \
  torch_threads=null logger=none progress=false "hydra.run.dir=$out/rg_smol"
run precision "$py" -m bench.precision --device cuda "${quick[@]}"
run bench "$py" -m bench.gpu "${quick[@]}"

echo "=== test_gpu: summary (logs in $out)"
failed=0
for line in "${results[@]}"; do
  echo "  $line"
  case $line in *"exit 0 "*|*skipped*) ;; *) failed=1 ;; esac
done
exit $failed
