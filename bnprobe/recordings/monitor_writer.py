"""The monitor's Parquet files, written by a thread of their own: at ``mon.step()`` the step's rows are handed over,
and the thread makes them one Arrow table (:func:`step_table`: a few numpy concatenations per column) and writes it
(:func:`write_table`) while the training goes on.  Most of the thread's work is pyarrow's native writer on a path,
which holds the GIL only briefly: more work in Python on a second thread would make the training thread wait for the
GIL after each of its torch ops.

At most :data:`QUEUE_STEPS` steps wait for the writer: a training loop faster than its disk waits at ``mon.step()``
instead of holding more steps in memory.  A write that fails is raised by the next ``mon.step()`` or at the monitor's
exit, as it was raised; the exit waits until every step handed over is on disk.  Each file is still written whole and
renamed into place (:func:`bnprobe._files.atomic_write_path`): a process killed outright loses the steps not yet
renamed (at most the step in progress and the :data:`QUEUE_STEPS` before it).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np

from bnprobe._files import atomic_write_path, file_mode

__all__ = ["QUEUE_STEPS", "StepWriter", "step_table", "write_table"]

#: steps handed over and not yet written, at most (the training thread waits beyond)
QUEUE_STEPS = 2


def step_table(rows: list[dict[str, Any]], unit: str) -> Any:
    """``rows`` (one dict per call: arrays of its channels or rows, the ``unit`` column among them, and scalars) as
    one pyarrow Table: each column the calls' arrays end to end (pyarrow directly: a DataFrame per call cost a third
    of the monitor's time on ResNet-50).  Keys starting with ``_`` are left out."""
    import pyarrow as pa

    n = [len(r[unit]) for r in rows]
    cols: dict[str, Any] = {}
    for k in rows[0]:
        if k.startswith("_"):
            continue
        if isinstance(rows[0][k], np.ndarray):
            cols[k] = np.concatenate([r[k] for r in rows], dtype=np.float64 if k != unit else np.int64)
        elif isinstance(rows[0][k], str):  # each call's name to its rows, through a dictionary (numpy's
            names, codes = np.unique([r[k] for r in rows], return_inverse=True)  # strings convert 25x slower)
            cols[k] = pa.DictionaryArray.from_arrays(np.repeat(codes.astype(np.int32), n),
                                                     pa.array(names)).cast(pa.string())
        else:
            cols[k] = np.repeat(np.array([r[k] for r in rows]), n)
    return pa.table(cols)


def write_table(path: Path, table: Any, dense: frozenset[str]) -> None:
    """``table`` as the Parquet file ``path``, written whole and renamed into place; the columns of ``dense`` are
    stored without compression."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = [f.name for f in table.schema if pa.types.is_string(f.type)]  # dictionaries for names only: 7x faster
    # no column statistics: a step's file is read whole (they cost 40% of the write on ResNet-50); no lz4 on
    # the statistics computed in float64 (little to find there: lz4 costs 28% of the write for 15% of the size)
    codec = {k: "none" if k in dense else "lz4" for k in table.column_names}
    atomic_write_path(path, lambda tmp: pq.write_table(table, str(tmp), compression=codec, use_dictionary=text,
                                                       write_statistics=False))


class StepWriter:
    """A thread writing each step's rows (:func:`step_table`, :func:`write_table`) in the order they are handed
    over."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=QUEUE_STEPS)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def put(self, path: Path, rows: list[dict[str, Any]], unit: str, dense: frozenset[str]) -> None:
        """Hand ``rows`` over to be written to ``path`` (:func:`step_table`, :func:`write_table`; the rows are not
        changed after this); a failed earlier write is raised here."""
        self._raise()
        if self._thread is None:
            file_mode()  # (read once here: reading the umask sets it for a moment, not to be done beside a write)
            self._thread = threading.Thread(target=self._run, name="bnprobe-monitor-writer", daemon=True)
            self._thread.start()
        self._queue.put((path, rows, unit, dense))

    def close(self) -> None:
        """Wait until every step handed over is written; a failed write is raised."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                path, rows, unit, dense = job
                write_table(path, step_table(rows, unit), dense)
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread at its next step
                if self._error is None:  # (the first failure is the one reported)
                    self._error = exc
