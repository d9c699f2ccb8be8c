# Sourced (not run) by the scripts that run on the GPU machine, from the repo root with `carry: [".whl"]`:
#   source tools/gpu_env.sh CACHE_NAME
# installs the wheels in .whl/ that the machine lacks (grain and its dependencies) into /tmp/site, sets the
# environment every run there needs, keeps a JAX compilation cache in /tmp/CACHE_NAME_xla_cache while the
# machine stays warm, and defines `wait_all PID...` (waits for every process; the last non-zero status).
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
