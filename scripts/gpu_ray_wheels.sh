#!/usr/bin/env bash
# Here (with the package registry): fill .whl-gpu/ray/ with what Ray needs on the lent GPU machine, whose image
# (Python 3.12, no network) has no Ray. Ray's wheel (79 MB) is more than one call carries (64 MiB), so it is split
# in two chunks; the small dependencies travel with the call that runs `scripts/gpu_scale.sh`, which installs them.
# Run from the project root after ../shared/gpu/fetch.sh; tests/GPU.md lists the calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl-gpu/ray/chunks .whl-gpu/ray/deps .whl-gpu/download
platforms=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for n in 17 24 27 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps "${platforms[@]}" -d "$1" "${@:2}"; }
if [ ! -f .whl-gpu/ray/chunks/ray.part00 ]; then
  get .whl-gpu/download ray==2.60.0
  split -b 40M -d .whl-gpu/download/ray-2.60.0-*.whl .whl-gpu/ray/chunks/ray.part
  rm -f .whl-gpu/download/ray-2.60.0-*.whl
fi
# Ray's own requirements; the install on the device skips any the image already imports.
for spec in msgpack protobuf pyyaml click filelock requests urllib3 charset-normalizer idna certifi packaging; do
  get .whl-gpu/ray/deps "$spec"
done
ls -la .whl-gpu/ray/chunks .whl-gpu/ray/deps
