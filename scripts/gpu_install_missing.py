"""On the lent GPU machine: install into a folder the wheels whose distribution the image does not already have.

    python3 scripts/gpu_install_missing.py /tmp/site .whl-gpu/sae/rest/*.whl /tmp/stash/sae/*.whl

A wheel whose distribution is importable (the image's own, or one installed before) is left out, so the image's
numpy, torch and transformers are never shadowed. Prints what it installed and what it left out.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path


def distribution_of(wheel: Path) -> str:
    return wheel.name.split("-")[0].replace("_", "-").lower()


def main() -> int:
    target, wheels = sys.argv[1], [Path(path) for path in sys.argv[2:]]
    missing, present = [], []
    for wheel in wheels:
        try:
            importlib.metadata.distribution(distribution_of(wheel))
            present.append(wheel.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(str(wheel))
    print(f"already present ({len(present)}): {', '.join(sorted(present)) or 'none'}")
    if not missing:
        return 0
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--target", target, *missing], capture_output=True, text=True)
    print(f"installed ({len(missing)}): {', '.join(sorted(Path(path).name for path in missing))}")
    if result.returncode:
        print(result.stdout[-2000:], result.stderr[-2000:])
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
