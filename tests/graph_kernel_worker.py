"""The graph ops' Triton kernels on the CPU, through Triton's interpreter, in a process of their own.

Triton decides at import whether its kernels (its own library's included)
are interpreted: ``TRITON_INTERPRET=1`` must be set before triton is first
imported, and a test process has imported it long before (vLLM, the
oracle). tests/test_graph_kernels.py therefore starts this file as a
subprocess with that variable and ``STREAMSCOPE_GRAPH_OPS_BODY=triton`` set,
and asks it for calls: the ops themselves (whose body is then the kernels)
or the kernels' launches with a chosen block of columns.

Each request on stdin and each answer on stdout is 8 bytes of length, then a
`torch.save` of a tuple. A request is ``(call, arguments, options, carried)``;
the answer ``(arguments, carried)`` after the call (the tensors it changed in
place come back changed; `carried` rides along to keep the storage a view
shares with its base) or ``("error", traceback)``.
"""

from __future__ import annotations

import io
import os
import struct
import sys
import traceback
from typing import Any, BinaryIO, Optional

import torch


def send(stream: BinaryIO, payload: Any) -> None:
    """Write one message: its length and its `torch.save` bytes."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def receive(stream: BinaryIO) -> Optional[Any]:
    """Read one message, or None where the stream has ended."""
    header = stream.read(8)
    if len(header) < 8:
        return None
    (length,) = struct.unpack("<Q", header)
    return torch.load(io.BytesIO(stream.read(length)), weights_only=True)


def serve() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from streamscope.vllm import graph_kernels, graph_ops

    if not isinstance(graph_kernels._edit_rows, InterpretedFunction):
        raise SystemExit("graph_kernel_worker: triton is not interpreted here: start it with TRITON_INTERPRET=1.")
    if os.environ.get(graph_ops.BODY_VARIABLE) != "triton":
        raise SystemExit(f"graph_kernel_worker: start it with {graph_ops.BODY_VARIABLE}=triton.")
    calls = {"edit_stream": graph_ops.edit_stream, "harvest_stream": graph_ops.harvest_stream,
             "edit_harvest_stream": graph_ops.edit_harvest_stream, "edit_rows": graph_kernels.edit_rows,
             "harvest_rows": graph_kernels.harvest_rows, "edit_harvest_rows": graph_kernels.edit_harvest_rows,
             "edit_stretch": graph_ops.edit_stretch, "edit_stretch_rows": graph_kernels.edit_stretch_rows}
    inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
    while True:
        request = receive(inbox)
        if request is None:
            return
        call, arguments, options, carried = request
        try:
            calls[call](*arguments, **options)
            answer: Any = (arguments, carried)
        except Exception:
            answer = ("error", traceback.format_exc())
        send(outbox, answer)


if __name__ == "__main__":
    serve()
