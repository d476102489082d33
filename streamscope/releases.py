"""What both seams do on a release of the library they read other than the ones they were read against.

`streamscope.nnsight_seam` (nnsight) and `streamscope.vllm_seam` (vLLM) each check the installed version when
they are imported and say what would break; `refuse_release` is what follows, for both: an ImportError, or, where
the user asked to try that release anyway, a warning. Nothing here imports either library.
"""

from __future__ import annotations

import os
import warnings


def refuse_release(message: str, allow_env: str) -> None:
    """Refuse the installed release: raise ImportError with `message` (which release is installed, which are
    supported, what breaks and the install that fixes it) and how to run it anyway.

    With ``<allow_env>=1`` in the environment the same message is a RuntimeWarning instead, shown at the line
    that called the seam's version check, and the import goes on.
    """
    message = f"{message} (or set {allow_env}=1 to try this one anyway, at your own risk)."
    if os.environ.get(allow_env) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # past this function and the seam's check
        return
    raise ImportError(message)
