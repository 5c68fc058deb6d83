#!/usr/bin/env bash
# One prepared run on a lent GPU machine (python3 there holds jax[cuda], flax, optax, orbax, chex, tensorstore,
# torch; no network): the tests that run on one GPU, then the W1 step benchmark with the generic kernel beside
# naive Flax (both on the GPU) and torch EmbeddingBag (CPU). Writes logs and JSON under $OUT (or ./gpu_out).
#
#     bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
# the C preprocess extension for this Python (the kernel extension is CPU-only: not needed here)
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"

# The suite's mesh fixtures skip what needs more devices than the one GPU; the rest runs on it. The offloaded
# tables' training, cache and raw-id tests too: their device half (the cache's gather and scatter) runs on the GPU.
TESTS=${TESTS:-tests/core tests/integrations tests/tiers/test_offload_training.py tests/tiers/test_cache.py tests/tiers/test_offload_raw_ids.py}
JAX_PLATFORMS=cuda timeout "${TEST_TIMEOUT:-250}" python3 -m pytest -p no:cacheprovider -p no:benchmark -n 4 -q \
    -W "ignore::DeprecationWarning" $TESTS --durations=5 2>&1 | tee "$OUT/tests.log" | tail -25

# W1 (8 tables x 1M x 64, batch 4096 x 20 ids): generic kernel on the GPU, one round
JAX_PLATFORMS=cuda,cpu timeout "${STEP_TIMEOUT:-240}" python3 benchmarks/step.py --kernels generic \
    --peers torch,flax --rounds 1 --no-vocab --json "$OUT/results_step_w1_gpu.json" 2>&1 | tee "$OUT/step.log" | tail -40
