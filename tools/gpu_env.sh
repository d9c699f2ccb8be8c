# Sourced (not run) by the scripts that run on the GPU machine, from the repo root with `carry: [".whl"]`:
#   source tools/gpu_env.sh CACHE_NAME
# installs the wheels in .whl/ that the machine lacks (grain and its dependencies) into /tmp/site, sets the
# environment every run there needs, keeps a JAX compilation cache in /tmp/CACHE_NAME_xla_cache while the
# machine stays warm, and defines `wait_all PID...` (waits for every process; the last non-zero status) and
# `gpu_for I` (the GPU that the I-th of several single-GPU processes should see: the GPUs are those in
# CUDA_VISIBLE_DEVICES, else all that nvidia-smi lists, the first LM_COMPARE_GPUS of them when that is set, taken
# round-robin; empty where there is one GPU or none, so that a lone GPU's processes keep the environment as it is).
if ! PYTHONPATH=/tmp/site python3 -c "import grain" 2>/dev/null; then  # installed by an earlier call: skip
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/${1:-mixerlab}_xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
wait_all() {
  local pid result=0
  for pid in "$@"; do wait "$pid" || result=$?; done
  return $result
}
gpu_list() {  # the GPUs that gpu_for spreads processes over, one per line; nothing for one GPU or none
  local -a gpus=()
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES// /}"
  else mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true); fi
  if [ -n "${LM_COMPARE_GPUS:-}" ] && (( LM_COMPARE_GPUS < ${#gpus[@]} )); then gpus=("${gpus[@]:0:LM_COMPARE_GPUS}"); fi
  if (( ${#gpus[@]} > 1 )); then printf '%s\n' "${gpus[@]}"; fi
}
gpu_for() {
  local -a gpus=()
  mapfile -t gpus < <(gpu_list)
  if (( ${#gpus[@]} )); then echo "${gpus[$(( $1 % ${#gpus[@]} ))]}"; fi
}
