#!/usr/bin/env bash
# Fill .whl-gpu/serve/ (ignored) with what vLLM's server imports that the lent H200's image lacks (uvicorn and its
# standard extras, aiohttp, model-hosting-container-standards) and py-spy, as cp312 wheels for that machine. What
# .whl-gpu/deps pins already (fastapi, starlette, pydantic and their kind) is left out, so these never shadow it.
# Run from the project root after ../shared/gpu/fetch.sh; the serve parts of scripts/gpu_plan.py carry the folder.
#
# hotwire-vllm 0.1.2 (pure Python, 25 kB; issue 39's side-by-side server in benchmarks/graph_serve.py) goes to
# .whl-gpu/serve/hotwire/, a folder of its own: it is a vLLM general plugin, loaded by every vLLM process that can
# import it, so it must not be installed with the rest (`pip install .whl-gpu/serve/*.whl` leaves the folder out);
# graph_serve.py unpacks it onto the hotwire server's path alone.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
platforms=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for n in 1 5 17 24 26 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p .whl-gpu/serve/hotwire
python3 -m pip download -q "${platforms[@]}" -d .whl-gpu/serve "uvicorn[standard]" aiohttp \
    model-hosting-container-standards py-spy
rm -f .whl-gpu/serve/{fastapi,starlette,pydantic,pydantic_core,annotated_types,annotated_doc,typing_extensions,typing_inspection,setuptools}-*.whl
# --no-deps: its one dependency (numpy) is on the machine already
python3 -m pip download -q --no-deps -d .whl-gpu/serve/hotwire hotwire-vllm==0.1.2
ls .whl-gpu/serve .whl-gpu/serve/hotwire
