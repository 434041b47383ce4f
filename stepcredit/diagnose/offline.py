"""Diagnosing credit on a user's own logged trajectories with per-step labels.

A log of step rows (`stepcredit.data.schema`) may carry one extra column of
per-step labels, for instance human step annotations: a number or a bool per
row, > 0 (True) for a good step, <= 0 (False) for a bad one. Each estimator
that can run offline computes its credit through `stepcredit credit`'s own
path (`stepcredit.data.offline.compute_credit`, whitening included); token
credit is averaged over each row's response tokens. The metrics
(`stepcredit.diagnose.metrics`) then take the labels as the truth: `good` is
label > 0, and the label's value stands in for A^pi in Spearman's rank
correlation and in sign agreement (positive for a good step, negative for a
bad one). A trajectory failed when its
score (the `score` column, else the sum of its rewards) is below
`success_threshold`. Intervals resample whole groups (`group_id`).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Sequence

import numpy as np

from stepcredit import advantages as adv
from stepcredit.data.offline import ADVANTAGE, TOKEN_ADVANTAGES, compute_credit
from stepcredit.diagnose.episodes import Stacked
from stepcredit.diagnose.result import Diagnosis, Example
from stepcredit.diagnose.run import grade, pick_examples
from stepcredit.keys import dense_ids


def _read(path: str) -> dict[str, list]:
    """A credited JSONL output as columns (every record holds the same keys)."""
    with open(path, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    return {name: [r.get(name) for r in records] for name in records[0]}


def _labels(table: dict[str, list], column: str) -> np.ndarray:
    if column not in table:
        raise ValueError(f"--label-column {column!r} is not a column of the log; its columns: "
                         f"{', '.join(table)}")
    values = table[column]
    out = np.empty(len(values))
    for row, value in enumerate(values):
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not np.isfinite(value):
            raise ValueError(f"--label-column {column!r}: row {row} holds {value!r}; each row "
                             "needs a finite number or a bool")
        out[row] = value
    return out


def _layout(table: dict[str, list]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row -> (trajectory b, step t), and the trajectories' group ids."""
    rows, _ = dense_ids(np.asarray([str(i) for i in table["trajectory_id"]], dtype=object))
    steps = np.asarray(table["step_index"], dtype=np.int64)
    groups = np.asarray([str(g) for g in table["group_id"]], dtype=object)
    group_of = np.empty(rows.max() + 1, dtype=object)
    group_of[rows] = groups
    group_ids, _ = dense_ids(group_of)
    return rows, steps, group_ids.astype(np.int32)


def _row_credit(table: dict[str, list]) -> np.ndarray:
    if ADVANTAGE in table:
        return np.asarray(table[ADVANTAGE], dtype=np.float64)
    return np.array([np.mean(tokens) for tokens in table[TOKEN_ADVANTAGES]])


def _stacked(table: dict[str, list], labels: np.ndarray, success_threshold: float) -> Stacked:
    """The log's trajectories as `[B, T]` truth: `good` is label > 0, and the
    label stands in for A^pi, shifted by -1 where it is <= 0 so that a bad
    step's sign is negative (ranks, hence Spearman, are unchanged)."""
    rows, steps, group_ids = _layout(table)
    b, t = rows.max() + 1, steps.max() + 1
    mask = np.zeros((b, t), bool)
    mask[rows, steps] = True
    label = np.full((b, t), np.nan)
    label[rows, steps] = np.where(labels > 0, labels, labels - 1.0)
    rewards = np.zeros((b, t))
    rewards[rows, steps] = table["reward"]
    scores = rewards.sum(1)
    if "score" in table:
        logged = np.asarray([np.nan if s is None else s for s in table["score"]], dtype=np.float64)
        known = np.isfinite(logged)
        scores[rows[known]] = logged[known]
    return Stacked(mask=mask, group_ids=group_ids, scores=scores.astype(np.float32),
                   won=scores >= success_threshold, good=mask & (np.nan_to_num(label) > 0),
                   advantage=label, advantage_se=np.where(mask, 0.0, np.nan),
                   seeds=np.zeros(b, np.int64))


def diagnose_log(source: str | os.PathLike, label_column: str, *, estimators: Sequence[str] = (),
                 success_threshold: float = 1.0, bootstrap: int = 200, examples: int = 4,
                 progress: bool = True) -> Diagnosis:
    """Grades estimators' credit on a labelled log of step rows (module doc).

    Args:
      source: a JSONL or Parquet file or a save_to_disk folder of step rows.
      label_column: the per-step label column.
      estimators: registered names; empty for every one that runs offline
        (not those that need an implicit PRM).
      success_threshold: a trajectory whose score reaches it succeeded.
      bootstrap: resamples per interval.
      examples: trajectories kept for plots.
      progress: show a progress bar over estimators.

    Returns:
      A `Diagnosis` whose env is the log's file name. Estimators the log
      cannot feed (a critic without a `value` column, EMPG without entropy)
      are left out, each with a note saying why.

    Raises:
      ValueError: the label column is missing or holds a non-number, or no
        estimator could run (each one's reason given: a bad record, say).
    """
    from tqdm.auto import tqdm

    names = tuple(estimators) or tuple(n for n in adv.names() if not adv.get(n).needs_prm)
    label = os.path.basename(os.path.normpath(os.fspath(source)))
    scores, notes, kept = [], [f"labels: column {label_column!r} (> 0: a good step); success: "
                                f"score >= {success_threshold:g}"], {}
    stacked = None
    with tempfile.TemporaryDirectory() as folder:
        for name in tqdm(names, desc="diagnose estimators", disable=not progress):
            # JSONL keeps the label column exactly as logged, whatever its type.
            output = os.path.join(folder, f"{len(kept)}.jsonl")
            try:
                compute_credit(source, output, name, progress=False)
            except ValueError as error:  # what this estimator reads is missing, or a bad record
                notes.append(f"{name}: not run: {error}")
                continue
            credited = _read(output)
            if stacked is None:
                stacked = _stacked(credited, _labels(credited, label_column), success_threshold)
            rows, steps, _ = _layout(credited)
            credit = np.zeros(stacked.mask.shape)
            credit[rows, steps] = _row_credit(credited)
            kept[name] = credit
            scores += grade(label, name, credit, stacked, seeds=(0,), bootstrap=bootstrap)
    if stacked is None:
        raise ValueError(f"--input {os.fspath(source)}: none of the estimators could run: "
                         + "; ".join(notes[1:]))
    actions = _step_names(stacked)
    picked = pick_examples(stacked.good, stacked.mask, stacked.won, examples)
    lengths = stacked.mask.sum(1)
    shown = tuple(Example(label, int(stacked.group_ids[i]), bool(stacked.won[i]), actions[i],
                          stacked.good[i, :lengths[i]], stacked.advantage[i, :lengths[i]],
                          np.zeros(lengths[i]), {n: c[i, :lengths[i]] for n, c in kept.items()})
                  for i in picked)
    settings = {"input": os.fspath(source), "label_column": label_column,
                "success_threshold": success_threshold, "bootstrap": bootstrap,
                "estimators": list(kept)}
    return Diagnosis(settings, tuple(scores), shown, {}, tuple(notes))


def _step_names(stacked: Stacked) -> list[tuple[str, ...]]:
    """Action labels for plots: the step number (logged actions are token ids, not text)."""
    return [tuple(f"step {t}" for t in range(int(n))) for n in stacked.mask.sum(1)]
