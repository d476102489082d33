"""Taps: the values a vLLM engine that replays CUDA graphs serves, declared when it starts.

An eager engine (streamscope's default) serves every value, at the cost of
launching every kernel of every step from Python. With ``taps=``, the engine
records vLLM's CUDA graphs with a break at each tap (vLLM's breakable graphs,
through nnsight's tapped interleaver), and at every replay runs the trace's or
the bulk run's work there, on the graph's own tensors. Values not tapped are
not served on such an engine; reading one is refused with the fix.

A tap is named as a value is read, with ``*`` for every block and ``a:b`` for a range::

    streamscope.load(path, engine="vllm", taps=["layers.16.layer_output"])
    streamscope.load(path, engine="vllm", taps=["layers.*.layer_output", "layers.3.self_attn.queries"])
    streamscope.load(path, engine="vllm", taps=["layers.8:12.mlp.mlp_output"])
    streamscope.load(path, engine="vllm", taps=["final_norm_output"])

Each resolves to the module call (input or output, or an operation inside a
forward) whose tensors hold the value; values at the same call share one break.

Decode steps replay graphs and prefill runs eagerly (``cudagraph_mode``
``FULL_DECODE_ONLY`` unless ``compilation_config`` says otherwise). Where an
attention backend cannot be captured (chunked local attention), vLLM lowers the
mode to ``NONE`` and every step runs eagerly; the engine's ``graph_mode`` says
which mode vLLM resolved, and loading warns when it is ``NONE``. vLLM's
breakable graphs are switched on by ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, which
stays set in the process: a plain vLLM engine started later in it records
breakable graphs too (an eager streamscope engine records none).
"""

from __future__ import annotations

from typing import Any, Iterable

from ..values import resolve


def _selected_blocks(selector: str, count: int, tap: str) -> list[int]:
    """The blocks `selector` names: ``*`` every block, ``4`` one (negative from the end), ``4:8`` a range."""
    if selector == "*":
        return list(range(count))
    try:
        if ":" in selector:
            start, _, stop = selector.partition(":")
            blocks = list(range(count))[slice(int(start) if start else None, int(stop) if stop else None)]
            if not blocks:
                raise IndexError(f"tap {tap!r}: blocks {selector} select none of the model's {count} blocks.")
            return blocks
        index = int(selector)
    except ValueError:
        raise ValueError(f"tap {tap!r}: the block is an index, a range 'a:b' or '*' (every block), "
                         f"not {selector!r}.") from None
    if not -count <= index < count:
        raise IndexError(f"tap {tap!r}: block {index} is out of range: the model has {count} blocks (0-{count - 1}).")
    return [index % count]


def _value_location(host: Any, path: str, tap: str) -> str:
    """The nnsight location of the value named by the dotted `path` (``self_attn.queries``) below `host`."""
    role, _, name = path.rpartition(".")
    owner = resolve(host, role) if role else host
    descriptor = getattr(type(owner), name, None)
    if descriptor is None or not hasattr(descriptor, "location"):
        raise ValueError(f"tap {tap!r}: {owner.where()} has no value {name!r}. A tap names a value as a trace "
                         f"reads it: 'layers.16.layer_output', 'layers.*.self_attn.queries', 'final_norm_output'.")
    return descriptor.location(owner)


def tap_locations(root: Any, taps: Iterable[str]) -> list[str]:
    """Every nnsight location (``<path>.output``, ``<path>.source.<call>.input``, ...) the `taps` name on `root`'s tree.

    Raises a ValueError or IndexError naming the tap for a name no value has,
    and `Unavailable` with the family's reason for a value the family does not
    serve.
    """
    if isinstance(taps, str):
        taps = [taps]
    locations: list[str] = []
    for tap in taps:
        if not isinstance(tap, str) or not tap:
            raise TypeError(f"taps are value names such as 'layers.16.layer_output', not {tap!r}.")
        head, _, rest = tap.partition(".")
        if head == "layers":
            selector, _, path = rest.partition(".")
            if not path:
                raise ValueError(f"tap {tap!r} names a block but no value: 'layers.{selector}.layer_output'.")
            hosts = [root.layers[index] for index in _selected_blocks(selector, len(root.layers), tap)]
        else:
            path, hosts = tap, [root]
        for host in hosts:
            location = _value_location(host, path, tap)  # Unavailable, with the family's reason, passes through
            if location not in locations:
                locations.append(location)
    return locations


__all__ = ["tap_locations"]
