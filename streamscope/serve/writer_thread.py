"""The thread in each engine process that hands a step's harvested rows to the harvest writer's process.

`streamscope.serve.worker.ServeState` queues, in step order, each harvest it admits, each step's harvested rows
(with the event their copy to host memory records, not waited for on the step's path) and each harvest dropped;
this thread waits for the copy to land and sends the bytes to `streamscope.serve.writer`'s process, or, where that
process cannot start or has stopped, keeps the harvests in a `Store` of its own.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from . import writer
from .writer import Store, send_frame

logger = logging.getLogger("streamscope.serve")


class HarvestWriter:
    """A thread that waits for each step's harvested rows to land in host memory and hands them to the writer.

    The writer is the harvest writer's process (`streamscope.serve.writer`),
    started with the thread on first use. Where that process cannot be
    started, or has stopped, the thread keeps a `Store` of its own (the
    harvests the process held then fail, saying why). Its queue is in step
    order, so a harvest is admitted before its rows come, and a request's rows
    from every step are stored before the step that completed it is written.
    """

    def __init__(self, folder: Optional[Path], rank: int) -> None:
        self.folder, self.rank = folder, rank
        self.queue: "queue.Queue[Any]" = queue.Queue()
        self.thread: Optional[threading.Thread] = None
        self.process: Optional[subprocess.Popen] = None
        self.store: Optional[Store] = None  # the thread's own, where the process is not running
        self.held: dict[int, str] = {}  # the harvests admitted to the process and not yet complete: key -> id

    def put(self, item: Any) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="streamscope-harvest-writer", daemon=True)
            self.thread.start()
        self.queue.put(item)

    def run(self) -> None:
        self.start()
        while True:
            item = self.queue.get()
            try:
                self.take(item)
            except Exception:  # noqa: BLE001  (logged; the thread goes on with the next step)
                logger.exception("streamscope serve: a step's harvested rows could not be handed to the writer")
            finally:
                self.queue.task_done()

    def start(self) -> None:
        """Start the writer's process (``STREAMSCOPE_SERVE_WRITER=thread``: write on this thread instead)."""
        if os.environ.get("STREAMSCOPE_SERVE_WRITER") == "thread":
            self.store = Store(self.folder, self.rank)
            return

        try:
            # -P: the script's folder (this package's modules: protocol, storage, ...) is not put on its path
            self.process = subprocess.Popen([sys.executable, "-P", writer.__file__, str(self.folder or ""),
                                             str(self.rank)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        except OSError:
            logger.exception("streamscope serve: the harvest writer's process did not start; writing on this thread")
            self.store = Store(self.folder, self.rank)

    def take(self, item: tuple) -> None:
        """Hand one queued item to the writer: a harvest admitted, a step's rows, or a harvest dropped."""
        kind = item[0]
        if kind == "rows":
            _, event, copies, complete = item
            if event is not None:
                event.synchronize()  # this step's copy to host memory has landed; the engine has not waited for it
            for number, (host, pieces) in enumerate(copies):
                done = complete if number == len(copies) - 1 else []
                self._send({"kind": "rows", "dtype": str(host.dtype), "pieces": pieces, "complete": done}, host,
                           lambda store, host=host, pieces=pieces, done=done: store.rows(host, pieces, done))
            for key in complete:
                self.held.pop(key, None)
        elif kind == "admit":
            _, key, record = item
            self._send({"kind": "admit", "key": key, "record": record.header()}, None,
                       lambda store: store.admit(key, record))
            if self.store is None:
                self.held[key] = record.harvest_id
        else:
            key = item[1]
            self.held.pop(key, None)
            self._send({"kind": "drop", "key": key}, None, lambda store: store.drop(key))

    def _send(self, header: dict[str, Any], payload: Optional[torch.Tensor], locally: Any) -> None:
        if self.store is None and self.process is not None:
            try:
                send_frame(self.process.stdin, header, payload)
                return
            except (OSError, ValueError):  # the process has gone: the harvests it held will not be written
                logger.exception("streamscope serve: the harvest writer's process stopped; writing on this thread")
                self.store = Store(self.folder, self.rank)
                for harvest_id in self.held.values():
                    self.store.fail(harvest_id, "the harvest writer's process stopped before writing this harvest")
                self.held.clear()
                if header["kind"] != "admit":
                    return  # this item's harvests were among those failed
        if self.store is not None:
            locally(self.store)
