"""Envoy classes an engine composes from an engine-neutral kind and its own layout, importable by a stable name.

A family states engine-neutral kinds (`streamscope.blocks`); each engine adds
what it needs to read them on its model (vLLM: fused halves, flat tokens, its
attention layer; transformers: the attention kernel's call) by composing a
class ``(engine part, kind)`` at load. A vLLM engine in another process gets
its envoys by reference (module and qualified name), so each composed class is
an attribute of its engine's module (`Composer.home`) under a name that says
how to build it again: ``Fused()[streamscope/blocks/post_norm:SandwichLayer]``
(the kind's dots written as ``/``, since pickle walks a dotted name). The module's
``__getattr__`` rebuilds one it has not made yet (`Composer.rebuild`).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def kind_token(kind: type) -> str:
    """`kind` as a name part: ``streamscope/blocks/layer:Layer``."""
    return f"{kind.__module__}:{kind.__qualname__}".replace(".", "/")


def kind_of(token: str) -> type:
    """The class `kind_token` named."""
    module, _, qualname = token.replace("/", ".").partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


class Composer:
    """Builds and keeps one engine's composed envoy classes, in the module `home`.

    Args:
        home: The module the classes are attributes of (its ``__getattr__``
            calls `rebuild`).
        part: Given the engine part's token (the text before ``[``), the class
            body to compose with a kind: ``(name prefix, bases before the kind,
            namespace builder)``, where the builder takes the kind.
    """

    def __init__(self, home: str, part: Callable[[str], tuple[str, tuple[type, ...], Callable[[type], dict]]]) -> None:
        self.home = home
        self.part = part
        self.classes: dict[str, type] = {}

    def compose(self, token: str, kind: type) -> type:
        """The class ``(engine part named by token, kind)``, built once per process."""
        qualname = f"{token}[{kind_token(kind)}]"
        found = self.classes.get(qualname)
        if found is None:
            prefix, bases, namespace = self.part(token)
            body = {**namespace(kind), "__module__": self.home, "__qualname__": qualname,
                    "__doc__": kind.__doc__}
            found = self.classes[qualname] = type(f"{prefix}{kind.__name__}", (*bases, kind), body)
            setattr(sys.modules[self.home], qualname, found)
        return found

    def rebuild(self, qualname: str) -> type:
        """The class named `qualname` in `home` (for another process's reference to it); AttributeError if the name
        is not one of this composer's."""
        token, bracket, rest = qualname.partition("[")
        if not bracket or not rest.endswith("]"):
            raise AttributeError(f"module {self.home!r} has no attribute {qualname!r}")
        return self.compose(token, kind_of(rest[:-1]))
