"""A batch job's output file, written so that a job killed at any point loses nothing and repeats
nothing when it is run again.

Each result is appended as one JSON line and flushed (and fsynced) as soon as its input finishes, so
a killed job has written every result it finished. Run again on the same output file, the job reads
the results back and skips their inputs: results are keyed by their `id` (the input line's own, else
its line number). A kill in the middle of a write leaves a torn last line, with no newline; it is
cut off on reading and its input runs again. Once every input is done the file is rewritten, in
input order, through a temporary file and a rename, so that no kill can lose what it held.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any


def result_key(line_id: str | int) -> str:
    """The key of a result: its id as JSON, so that the string "7" and the number 7 stay apart."""
    return json.dumps(line_id)


class ResultsFile:
    """The output JSONL of a batch job: the results already there, and the appending of new ones.

    Opening it reads the finished results back and cuts off a torn last line; `append` writes one
    result durably; `close_in_order` puts the results in input order. Raises ValueError when the file
    holds a complete line that is no result, which no kill can cause: it is not this job's output.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}  # every result in the file, by key
        self.num_done_before = 0
        self._file: IO[str] | None = None
        if path.exists():
            self._read_back()
            self.num_done_before = len(self.records)

    def _read_back(self) -> None:
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1  # what follows the last newline was torn by a kill
        for number, row in enumerate(data[:complete].decode("utf-8").split("\n")[:-1], start=1):
            try:
                record = json.loads(row)
                key = result_key(record["id"])
            except (ValueError, TypeError, KeyError):
                raise ValueError(
                    f"{self.path} line {number} is not a batch result; give another --output, or remove it "
                    "to start afresh"
                ) from None
            self.records[key] = record
        if complete < len(data):
            with self.path.open("r+b") as file:
                file.truncate(complete)

    def is_done(self, line_id: str | int) -> bool:
        return result_key(line_id) in self.records

    def append(self, record: dict[str, Any]) -> None:
        """Write one result as a line and make it durable before returning."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[result_key(record["id"])] = record

    def close_in_order(self, ids: Iterable[str | int]) -> None:
        """Close the file, rewritten with the results of `ids` first in that order (then any other)."""
        self.close()
        order = list(dict.fromkeys(key for key in map(result_key, ids) if key in self.records))
        keys = order + [key for key in self.records if key not in set(order)]
        temporary = self.path.with_name(self.path.name + ".tmp")
        with temporary.open("w", encoding="utf-8") as file:
            for key in keys:
                file.write(json.dumps(self.records[key], ensure_ascii=False) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
