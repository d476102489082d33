#!/usr/bin/env bash
# Fill .whl-gpu/serve/ (ignored) with what vLLM's server imports that the lent H200's image lacks (uvicorn and its
# standard extras, aiohttp, model-hosting-container-standards) and py-spy, as cp312 wheels for that machine. What
# .whl-gpu/deps pins already (fastapi, starlette, pydantic and their kind) is left out, so these never shadow it.
# Run from the project root after ../shared/gpu/fetch.sh; the serve parts of scripts/gpu_plan.py carry the folder.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
platforms=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for n in 1 5 17 24 26 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl-gpu/serve
python3 -m pip download -q "${platforms[@]}" -d .whl-gpu/serve "uvicorn[standard]" aiohttp \
    model-hosting-container-standards py-spy
rm -f .whl-gpu/serve/{fastapi,starlette,pydantic,pydantic_core,annotated_types,annotated_doc,typing_extensions,typing_inspection,setuptools}-*.whl
ls .whl-gpu/serve
