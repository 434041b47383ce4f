"""Per-iteration metrics to tensorboardX event files and to a JSONL file."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Callable, Mapping


class MetricsLogger:
    """Writes scalar metrics per iteration to `<logdir>/metrics.jsonl` and TensorBoard.

    The JSONL file is appended to and flushed every iteration, so a run that is
    killed keeps every finished iteration; on resume, lines for iterations at or
    after the resumed one are dropped first, so the file never holds duplicates,
    and a half-written last line (what a kill mid-write leaves) is dropped with
    a note.

    Args:
      logdir: the run directory.
      resume_from: the iteration the run resumes at; None starts a new file.
      note: where the note on a dropped partial line goes (stderr by default).
    """

    def __init__(self, logdir: str, *, resume_from: int | None = None,
                 note: Callable[[str], None] | None = None):
        from tensorboardX import SummaryWriter

        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, "metrics.jsonl")
        self._note = note or (lambda text: print(text, file=sys.stderr))
        if resume_from is not None and os.path.exists(self.path):
            self._truncate_after(resume_from)
        elif resume_from is None and os.path.exists(self.path):
            os.remove(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._writer = SummaryWriter(logdir=os.path.join(logdir, "tensorboard"))

    def _truncate_after(self, iteration: int) -> None:
        rows, partial = _read_rows(self.path)
        if partial:
            self._note(f"{self.path}: dropped a partial last line (a run killed mid-write)")
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows if row["iteration"] < iteration)
        os.replace(tmp, self.path)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Records `metrics` (name -> number) for `iteration`."""
        row = {"iteration": iteration}
        for name, value in sorted(metrics.items()):
            value = float(value)
            row[name] = value if math.isfinite(value) else None
            if math.isfinite(value):
                self._writer.add_scalar(name, value, iteration)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._writer.flush()

    def close(self) -> None:
        self._file.close()
        self._writer.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_rows(path: str) -> tuple[list[dict], bool]:
    """The rows of a metrics file, and whether a partial last line was left out.

    Raises:
      ValueError: a line other than the last is not JSON (naming the line).
    """
    with open(path, encoding="utf-8") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = []
    for position, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            if position == len(lines) - 1 and not line.endswith("\n"):
                return rows, True
            raise ValueError(f"{path}: line {number} is not a metrics record ({error})") from None
    return rows, False


def read_metrics(logdir: str) -> list[dict]:
    """Reads back the rows of `<logdir>/metrics.jsonl` (without a partial last line)."""
    return _read_rows(os.path.join(logdir, "metrics.jsonl"))[0]
