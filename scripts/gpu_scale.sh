#!/usr/bin/env bash
# Issue 23's GPU claims in one command, on the lent two-GPU machine (`nvidia-h200-x2`):
#   bash scripts/gpu_scale.sh            # both parts (each under its own time limit)
#   bash scripts/gpu_scale.sh parallel   # PP=2 and TP=2 against one GPU, every value (llama, mixtral, gemma2, gpt2)
#   bash scripts/gpu_scale.sh ray        # W1 on Ray: two replicas (a GPU each) against one; bound >= 1.8x
# after the vLLM install calls and the two Ray chunk calls of tests/GPU.md (this call carries .whl-gpu/deps,
# .whl-gpu/install.sh and .whl-gpu/ray/deps). Logs go to $OUT (or /tmp/gpu_scale).
set -uo pipefail
part=${1:-all}
out=${OUT:-/tmp/gpu_scale}
mkdir -p "$out"
bash .whl-gpu/install.sh >/dev/null || { echo "vLLM's install failed: make the chunk calls of tests/GPU.md first"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || { echo "this needs two GPUs (nvidia-h200-x2); this machine has $gpus"; exit 3; }

install_ray() {
  python3 -c "import ray" 2>/dev/null && return 0
  ls /tmp/stash/ray/ray.part* >/dev/null 2>&1 || { echo "Ray's chunks are not in /tmp/stash/ray: make the two Ray chunk calls"; return 3; }
  cat /tmp/stash/ray/ray.part* > /tmp/stash/ray/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  local wheels=(/tmp/stash/ray/ray-2.60.0-*.whl) wheel module
  declare -A modules=([msgpack]=msgpack [protobuf]=google.protobuf [PyYAML]=yaml [pyyaml]=yaml [click]=click
                      [filelock]=filelock [requests]=requests [urllib3]=urllib3 [charset_normalizer]=charset_normalizer
                      [idna]=idna [certifi]=certifi [packaging]=packaging)
  for wheel in .whl-gpu/ray/deps/*.whl; do  # only what the image lacks: never shadow its own copies
    module=${modules[$(basename "$wheel" | cut -d- -f1)]:-}
    [ -n "$module" ] && python3 -c "import $module" 2>/dev/null && continue
    wheels+=("$wheel")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" 2>&1 | grep -vi warning
  python3 -c "import ray; print('ray', ray.__version__)"
}

status=0
if [ "$part" = all ] || [ "$part" = parallel ]; then
  STREAMSCOPE_TEST_DEVICE=cuda STREAMSCOPE_TEST_DTYPE=bfloat16 timeout 420 python3 -m pytest -q -p no:cacheprovider \
    tests/vllm/test_pipeline_parallel.py tests/vllm/test_tensor_parallel.py 2>&1 | tee "$out/parallel.log" | tail -25
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if [ "$part" = all ] || [ "$part" = ray ]; then
  install_ray || exit 3
  timeout 420 python3 benchmarks/ray_harvest.py 2>&1 | tee "$out/ray.log" | grep -v "^INFO\|^WARNING\|^(" | tail -30
  status=$(( status | ${PIPESTATUS[0]} ))
fi
exit $status
