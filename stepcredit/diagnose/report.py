"""Writing a diagnosis down: a Markdown table, a CSV, a JSON copy and two PNG plots.

`write_report(diagnosis, directory)` writes, each file atomically (a temporary
file beside it, then a rename, so a failed write leaves the previous file as
it was):

- `diagnose.md`: the settings, one table per simulator (estimators by row,
  metrics by column, each cell the estimate and its 95% interval), a legend,
  the notes and the seconds per phase (`markdown`);
- `diagnose.csv`: one row per score (`csv_rows`);
- `diagnose.json`: the whole `Diagnosis`, which `load_json` reads back so a
  reader can re-plot without rerunning;
- `auc.png`: AUC per estimator per simulator with its interval (`plot_auc`);
- `examples.png`: a few trajectories' Monte Carlo A^pi next to the step
  credit of a few estimators (`plot_examples`).

The plots draw on a `matplotlib.figure.Figure` with the Agg canvas directly:
no pyplot, no global backend switch, nothing shown.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from stepcredit.data.write import atomic_path
from stepcredit.diagnose.result import METRICS, Diagnosis, Example, Score

# Reference rows: the Monte Carlo truth as an estimator (an upper bound) and random credit (a floor).
UPPER_REFERENCE = "mc_advantage"
LOWER_REFERENCE = "random"

# The estimators `plot_examples` shows by default, those present, in this order.
DEFAULT_EXAMPLE_ESTIMATORS = ("grpo", "gigpo", "step_gae", "empg")

CSV_COLUMNS = ("env", "estimator", "metric", "estimate", "low", "high", "n", "per_seed")

FILES = {"markdown": "diagnose.md", "csv": "diagnose.csv", "json": "diagnose.json",
         "auc": "auc.png", "examples": "examples.png"}

_HEADERS = {"auc": "AUC ↑", "spearman": "Spearman ↑", "sign_agreement": "sign agreement ↑",
            "blame_localisation": "blame localisation ↑", "collateral_blame": "collateral blame ↓"}

LEGEND = (
    "**AUC**: the probability that a random oracle-good step gets more credit than a random "
    "oracle-bad step, a tie counting one half (0.5 is chance; equal credit for every step "
    "gives 0.5). **Spearman**: the rank correlation between the step "
    "credit and the Monte Carlo advantage A^pi. **Sign agreement**: among the steps whose "
    "A^pi interval excludes 0, the share whose credit has the same sign as A^pi. "
    "**Blame localisation**: among failed trajectories of two or more steps with exactly one bad "
    "step, the share where that step gets the lowest credit of the trajectory (ties shared; "
    "credit equal on every step scores 1/T). **Collateral blame**: the share "
    "of good steps in failed trajectories that get negative credit (lower is better). Each cell "
    "is the estimate on all seeds pooled and its 95% bootstrap interval over (seed, task) "
    "groups; `n/a` where no item qualified; the *n* row counts the steps (trajectories for "
    "blame localisation) each metric used. `mc_advantage` grades A^pi itself (an upper bound) "
    "and `random` random credit (a floor).")

_SIMULATOR_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


# --------------------------------------------------------------------------- ordering and formats


def _finite(x: float) -> bool:
    return x is not None and math.isfinite(x)


def _metrics(diagnosis: Diagnosis) -> list[str]:
    """`METRICS`, then any other metric the scores hold, in order of appearance."""
    extra = dict.fromkeys(s.metric for s in diagnosis.scores if s.metric not in METRICS)
    return list(METRICS) + list(extra)


def _scores(diagnosis: Diagnosis, env: str) -> dict[tuple[str, str], Score]:
    return {(s.estimator, s.metric): s for s in diagnosis.scores if s.env == env}


def _ordered(estimators: Iterable[str], auc: Mapping[str, float]) -> list[str]:
    """"mc_advantage" first, "random" last, the others by AUC descending (NaN last, ties stable)."""
    estimators = list(dict.fromkeys(estimators))
    others = [e for e in estimators if e not in (UPPER_REFERENCE, LOWER_REFERENCE)]
    known = sorted((e for e in others if _finite(auc.get(e, math.nan))), key=lambda e: -auc[e])
    unknown = [e for e in others if not _finite(auc.get(e, math.nan))]
    return ([UPPER_REFERENCE] if UPPER_REFERENCE in estimators else []) + known + unknown + (
        [LOWER_REFERENCE] if LOWER_REFERENCE in estimators else [])


def estimator_order(diagnosis: Diagnosis, env: str | None = None) -> list[str]:
    """The estimators in table order: "mc_advantage", the others by AUC descending, "random".

    Args:
      diagnosis: the diagnosis.
      env: order by the AUC on this simulator (only its estimators); None: by
        the mean AUC over the simulators that have one (all estimators).

    Returns:
      Estimator names; those without a finite AUC come after the others, in
      the order the scores hold them, and before "random".
    """
    if env is not None:
        scores = [s for s in diagnosis.scores if s.env == env]
        auc = {s.estimator: s.estimate for s in scores if s.metric == "auc"}
        return _ordered((s.estimator for s in scores), auc)
    values: dict[str, list[float]] = {}
    for s in diagnosis.scores:
        if s.metric == "auc" and _finite(s.estimate):
            values.setdefault(s.estimator, []).append(s.estimate)
    auc = {e: float(np.mean(v)) for e, v in values.items()}
    return _ordered(diagnosis.estimators, auc)


def format_cell(score: Score | None) -> str:
    """`0.81 [0.77, 0.85]`: the estimate and its 95% interval to 2 decimals; `n/a` for NaN.

    An estimate without a finite interval is shown alone (`0.81`).
    """
    if score is None or not _finite(score.estimate):
        return "n/a"
    if not (_finite(score.low) and _finite(score.high)):
        return f"{score.estimate:.2f}"
    return f"{score.estimate:.2f} [{score.low:.2f}, {score.high:.2f}]"


def _cell_text(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _setting_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (list, tuple, dict)) for v in value):
        return ",".join(_setting_text(v) for v in value)
    if isinstance(value, Mapping):
        return json.dumps(_jsonable(value), separators=(",", ":"))
    return str(value)


def _n_text(scores: Sequence[Score]) -> str:
    counts = sorted({int(s.n) for s in scores})
    if not counts:
        return "–"
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


# --------------------------------------------------------------------------- Markdown


def markdown(diagnosis: Diagnosis) -> str:
    """The diagnosis as a Markdown report.

    Contents, in order: a title and one line of settings; per simulator a
    table with one row per estimator ("mc_advantage" first, "random" last,
    the others by AUC descending, NaN last) and one column per metric (each
    cell `estimate [low, high]`, 2 decimals, `n/a` for NaN), closed by an
    *n* row (the items each metric counted, or their range when the
    estimators differ); a legend saying what each metric measures; the notes
    as a bullet list; the seconds per phase.

    Args:
      diagnosis: a `Diagnosis`.

    Returns:
      The report, ending in a newline.
    """
    metrics = _metrics(diagnosis)
    settings = "; ".join(f"{key}={_setting_text(value)}" for key, value in diagnosis.settings.items())
    lines = ["# Step-credit diagnosis", "", f"**Settings:** {settings or '(none)'}", ""]
    for env in diagnosis.envs:
        scores = _scores(diagnosis, env)
        lines += [f"## {env}", "",
                  "| estimator | " + " | ".join(_HEADERS.get(m, m) for m in metrics) + " |",
                  "|---|" + "---|" * len(metrics)]
        for estimator in estimator_order(diagnosis, env):
            cells = [format_cell(scores.get((estimator, m))) for m in metrics]
            lines.append(f"| {_cell_text(estimator)} | " + " | ".join(cells) + " |")
        counts = [_n_text([s for (_, metric), s in scores.items() if metric == m]) for m in metrics]
        lines += ["| *n* | " + " | ".join(counts) + " |", ""]
    lines += ["## Legend", "", LEGEND, ""]
    if diagnosis.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in diagnosis.notes] + [""]
    if diagnosis.seconds:
        total = sum(float(s) for s in diagnosis.seconds.values())
        phases = " · ".join(f"{phase} {float(s):.1f} s" for phase, s in diagnosis.seconds.items())
        lines += ["## Time", "", f"{phases} · total {total:.1f} s", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CSV


def csv_rows(diagnosis: Diagnosis) -> list[dict]:
    """One dict per score, with the keys `CSV_COLUMNS`.

    `estimate`, `low`, `high` are floats (the `csv` module writes them with
    repr precision, NaN as `nan`), `n` an int, and `per_seed` the per-seed
    values as `;`-joined float reprs (`""` when there are none).
    """
    return [{"env": s.env, "estimator": s.estimator, "metric": s.metric,
             "estimate": float(s.estimate), "low": float(s.low), "high": float(s.high),
             "n": int(s.n), "per_seed": ";".join(repr(float(v)) for v in s.per_seed)}
            for s in diagnosis.scores]


def write_csv(diagnosis: Diagnosis, path: str | os.PathLike) -> pathlib.Path:
    """Writes `csv_rows(diagnosis)` to `path` atomically, with a header row; returns the path."""
    path = pathlib.Path(path)
    with atomic_path(path) as temporary:
        with open(temporary, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(csv_rows(diagnosis))
    return path


def load_csv(path: str | os.PathLike) -> tuple[Score, ...]:
    """The scores of a CSV that `write_csv` wrote, exactly (floats are written with repr).

    Raises:
      ValueError: the header is not `CSV_COLUMNS`.
    """
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
            raise ValueError(f"{path}: the CSV columns are {reader.fieldnames} but a diagnosis CSV "
                             f"has {list(CSV_COLUMNS)}")
        return tuple(Score(env=row["env"], estimator=row["estimator"], metric=row["metric"],
                           estimate=float(row["estimate"]), low=float(row["low"]),
                           high=float(row["high"]), n=int(row["n"]),
                           per_seed=tuple(float(v) for v in row["per_seed"].split(";") if v))
                     for row in reader)


# --------------------------------------------------------------------------- JSON


def _json_float(value: float) -> float | str | None:
    value = float(value)
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _jsonable(value: Any) -> Any:
    """Lists for arrays and tuples, plain Python scalars, NaN as None, infinities as "inf"/"-inf"."""
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _floats(values: Sequence[Any]) -> np.ndarray:
    return np.array([_float(v) for v in values], dtype=np.float64)


def to_json(diagnosis: Diagnosis) -> dict:
    """The diagnosis as a JSON-ready dict: arrays as lists, NaN as None, infinities as "inf"."""
    return {
        "settings": _jsonable(diagnosis.settings),
        "scores": [{"env": s.env, "estimator": s.estimator, "metric": s.metric,
                    "estimate": _json_float(s.estimate), "low": _json_float(s.low),
                    "high": _json_float(s.high), "n": int(s.n),
                    "per_seed": [_json_float(v) for v in s.per_seed]} for s in diagnosis.scores],
        "examples": [{"env": e.env, "task": int(e.task), "won": bool(e.won),
                      "actions": list(e.actions), "good": np.asarray(e.good, bool).tolist(),
                      "advantage": _jsonable(np.asarray(e.advantage, np.float64)),
                      "advantage_se": _jsonable(np.asarray(e.advantage_se, np.float64)),
                      "credit": {name: _jsonable(np.asarray(c, np.float64))
                                 for name, c in e.credit.items()}}
                     for e in diagnosis.examples],
        "seconds": {phase: _json_float(s) for phase, s in diagnosis.seconds.items()},
        "notes": list(diagnosis.notes),
    }


def from_json(data: Mapping[str, Any]) -> Diagnosis:
    """The `Diagnosis` of a `to_json` dict (arrays as float64 NumPy arrays, `good` as bool).

    Raises:
      ValueError: a field of a diagnosis is missing.
    """
    missing = [k for k in ("settings", "scores", "examples", "seconds") if k not in data]
    if missing:
        raise ValueError(f"not a diagnosis: the JSON lacks {missing} (it has {sorted(data)})")
    scores = tuple(Score(env=s["env"], estimator=s["estimator"], metric=s["metric"],
                         estimate=_float(s["estimate"]), low=_float(s["low"]),
                         high=_float(s["high"]), n=int(s["n"]),
                         per_seed=tuple(_float(v) for v in s["per_seed"]))
                   for s in data["scores"])
    examples = tuple(Example(env=e["env"], task=int(e["task"]), won=bool(e["won"]),
                             actions=tuple(e["actions"]), good=np.array(e["good"], dtype=bool),
                             advantage=_floats(e["advantage"]),
                             advantage_se=_floats(e["advantage_se"]),
                             credit={name: _floats(c) for name, c in e["credit"].items()})
                     for e in data["examples"])
    return Diagnosis(settings=dict(data["settings"]), scores=scores, examples=examples,
                     seconds={phase: _float(s) for phase, s in data["seconds"].items()},
                     notes=tuple(data.get("notes", ())))


def write_json(diagnosis: Diagnosis, path: str | os.PathLike) -> pathlib.Path:
    """Writes `to_json(diagnosis)` to `path` atomically (indented, no NaN literals); returns the path."""
    path = pathlib.Path(path)
    text = json.dumps(to_json(diagnosis), indent=1, allow_nan=False, ensure_ascii=False) + "\n"
    with atomic_path(path) as temporary:
        pathlib.Path(temporary).write_text(text, encoding="utf-8")
    return path


def load_json(path: str | os.PathLike) -> Diagnosis:
    """Reads back the `Diagnosis` that `write_json` (or `write_report`) wrote.

    Args:
      path: a `diagnose.json`, or the folder `write_report` wrote it into.

    Returns:
      A `Diagnosis` equal to the one written, but for: arrays come back as
      float64 (`good` as bool), tuples inside `settings` as lists.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / FILES["json"]
    with open(path, encoding="utf-8") as f:
        return from_json(json.load(f))


# --------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png")
    return path


def _colours(envs: Sequence[str]) -> dict[str, str]:
    return {env: _SIMULATOR_COLOURS[i % len(_SIMULATOR_COLOURS)] for i, env in enumerate(envs)}


def plot_auc(diagnosis: Diagnosis, path: str | os.PathLike) -> pathlib.Path:
    """Writes a PNG of each estimator's AUC on each simulator, with its 95% interval.

    One row per estimator (table order by mean AUC, see `estimator_order`),
    one dot per simulator in that simulator's colour with whiskers to the
    interval's ends, and a dashed line at 0.5 (chance). The file is written
    atomically.

    Returns:
      `path`.
    """
    envs = diagnosis.envs
    estimators = [e for e in estimator_order(diagnosis)
                  if any(s.estimator == e and s.metric == "auc" for s in diagnosis.scores)]
    figure = _figure(7.5, 1.2 + 0.45 * max(len(estimators), 1) + 0.1 * len(envs))
    axis = figure.add_subplot()
    if not estimators:
        axis.text(0.5, 0.5, "no AUC scores", ha="center", va="center", transform=axis.transAxes)
        axis.set_axis_off()
        return _save(figure, path)
    colours = _colours(envs)
    offsets = np.linspace(-0.25, 0.25, len(envs)) if len(envs) > 1 else [0.0]
    rows = {estimator: i for i, estimator in enumerate(estimators)}
    for env, offset in zip(envs, offsets):
        scores = [s for s in diagnosis.scores
                  if s.env == env and s.metric == "auc" and _finite(s.estimate)]
        if not scores:
            continue
        y = np.array([rows[s.estimator] + offset for s in scores])
        x = np.array([s.estimate for s in scores])
        low = np.array([s.estimate - s.low if _finite(s.low) else 0.0 for s in scores])
        high = np.array([s.high - s.estimate if _finite(s.high) else 0.0 for s in scores])
        axis.errorbar(x, y, xerr=np.stack([np.maximum(low, 0), np.maximum(high, 0)]), fmt="o",
                      color=colours[env], ecolor=colours[env], capsize=3, markersize=5, label=env)
    axis.axvline(0.5, color="grey", linestyle="--", linewidth=1, label="chance (0.5)")
    axis.set_yticks(range(len(estimators)), estimators)
    axis.set_ylim(len(estimators) - 0.5, -0.5)
    axis.set_xlim(0.0, 1.0)
    axis.set_xlabel("AUC: oracle-good vs bad steps (dots: estimate, whiskers: 95% interval)")
    axis.set_title("Step credit against oracle progress labels")
    axis.grid(axis="x", alpha=0.3)
    axis.legend(loc="best", fontsize=8, framealpha=0.9)
    return _save(figure, path)


def _chosen_examples(examples: Sequence[Example], limit: int) -> list[Example]:
    """Up to `limit` examples taken in turn from each simulator (so panels span simulators)."""
    by_env: dict[str, list[Example]] = {}
    for example in examples:
        by_env.setdefault(example.env, []).append(example)
    chosen, depth = [], 0
    while len(chosen) < limit and any(depth < len(v) for v in by_env.values()):
        chosen += [v[depth] for v in by_env.values() if depth < len(v)][:limit - len(chosen)]
        depth += 1
    return chosen


def _example_estimators(examples: Sequence[Example], estimators: Sequence[str] | None) -> list[str]:
    present = list(dict.fromkeys(name for e in examples for name in e.credit))
    if estimators is not None:
        unknown = [name for name in estimators if name not in present]
        if unknown:
            raise ValueError(f"plot_examples: no example has credit of {unknown}; the examples have "
                             f"{present}")
        return list(estimators)
    chosen = [name for name in DEFAULT_EXAMPLE_ESTIMATORS if name in present]
    others = [name for name in present if name not in chosen
              and name not in (UPPER_REFERENCE, LOWER_REFERENCE)]
    return (chosen + others)[:4]


def _scaled(credit: np.ndarray) -> tuple[np.ndarray, float]:
    """`credit` divided by its largest finite absolute value (by 1 when that is 0), and that value."""
    credit = np.asarray(credit, np.float64)
    finite = np.abs(credit[np.isfinite(credit)])
    largest = float(finite.max()) if finite.size else 0.0
    return credit / (largest or 1.0), largest


def plot_examples(diagnosis: Diagnosis, path: str | os.PathLike, *,
                  estimators: Sequence[str] | None = None, limit: int = 6) -> pathlib.Path:
    """Writes a PNG of example trajectories: the Monte Carlo A^pi next to estimators' step credit.

    One panel per example (up to `limit`, taken in turn from each simulator).
    Left axis: A^pi per step with its ±1.96 se band, markers green on
    oracle-good steps and red on bad ones, the axis symmetric about 0. Right
    axis: each estimator's credit divided by its largest absolute value on
    that trajectory (so shapes compare; the values divided by are under the
    x axis). x ticks are step numbers (1 = first step). The file is written
    atomically.

    Args:
      diagnosis: the diagnosis.
      path: the PNG to write.
      estimators: the credit to draw; default: those of "grpo", "gigpo",
        "step_gae", "empg" present, then the first other non-reference ones,
        up to 4.
      limit: the most panels.

    Returns:
      `path`.

    Raises:
      ValueError: an estimator in `estimators` has credit in no example.
    """
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    examples = _chosen_examples(diagnosis.examples, limit)
    if not examples:
        figure = _figure(6, 2)
        figure.text(0.5, 0.5, "no example trajectories", ha="center", va="center")
        return _save(figure, path)
    names = _example_estimators(examples, estimators)
    columns = min(3, len(examples))
    rows = -(-len(examples) // columns)
    figure = _figure(5.2 * columns, 3.6 * rows + 0.6)
    palette = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:cyan", "tab:pink")
    line_colours = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    line_styles = {name: ("-", "--", "-.", ":")[i % 4] for i, name in enumerate(names)}
    for i, example in enumerate(examples):
        axis = figure.add_subplot(rows, columns, i + 1)
        steps = np.arange(1, len(example.advantage) + 1)
        advantage = np.asarray(example.advantage, np.float64)
        band = 1.96 * np.asarray(example.advantage_se, np.float64)
        good = np.asarray(example.good, bool)
        axis.fill_between(steps, advantage - band, advantage + band, color="0.82")
        axis.plot(steps, advantage, color="black", linewidth=1.2)
        axis.scatter(steps, advantage, c=np.where(good, "tab:green", "tab:red"), zorder=3, s=28)
        axis.axhline(0.0, color="grey", linewidth=0.8)
        reach = np.abs(np.concatenate([advantage - band, advantage + band]))
        reach = float(np.nanmax(reach)) if np.isfinite(reach).any() else 1.0
        axis.set_ylim(-1.15 * (reach or 1.0), 1.15 * (reach or 1.0))  # 0 level with the credit's 0
        axis.set_ylabel("Monte Carlo A^pi (±1.96 se)")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_title(f"{example.env} · task {example.task} · {'won' if example.won else 'lost'}",
                       fontsize=10)
        twin = axis.twinx()
        maxima = []
        for name in names:
            if name in example.credit:
                scaled, scale = _scaled(example.credit[name])
                twin.plot(steps, scaled, color=line_colours[name], linestyle=line_styles[name],
                          linewidth=1.4)
                maxima.append(f"{name} {scale:.3g}")
        twin.set_ylim(-1.15, 1.15)
        twin.set_ylabel("credit ÷ its max |credit| on this trajectory", fontsize=8)
        axis.set_xlabel("step\nmax |credit|: " + " · ".join(maxima), fontsize=8)
    markers = [Line2D([], [], color="black", marker="o", markerfacecolor=colour, linestyle="",
                      label=f"A^pi, oracle-{kind} step")
               for colour, kind in (("tab:green", "good"), ("tab:red", "bad"))]
    lines = [Line2D([], [], color=line_colours[name], linestyle=line_styles[name], label=name)
             for name in names]
    figure.legend(handles=markers + [Line2D([], [], color="0.82", linewidth=6, label="±1.96 se")]
                  + lines, loc="outside upper center", ncols=3 + len(lines), fontsize=8)
    return _save(figure, path)


# --------------------------------------------------------------------------- all files


def write_markdown(diagnosis: Diagnosis, path: str | os.PathLike) -> pathlib.Path:
    """Writes `markdown(diagnosis)` to `path` atomically; returns the path."""
    path = pathlib.Path(path)
    with atomic_path(path) as temporary:
        pathlib.Path(temporary).write_text(markdown(diagnosis), encoding="utf-8")
    return path


def write_report(diagnosis: Diagnosis, directory: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Writes the report files of `diagnosis` into `directory` (created if needed).

    Files (`FILES`): `diagnose.md` (`markdown`), `diagnose.csv` (`csv_rows`),
    `diagnose.json` (the whole diagnosis, `load_json` reads it back),
    `auc.png` (`plot_auc`), `examples.png` (`plot_examples`). Each is written
    atomically: a failed write leaves that file as it was and no temporary
    file behind.

    Returns:
      {"markdown", "csv", "json", "auc", "examples"} -> the path written.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    writers = {"markdown": write_markdown, "csv": write_csv, "json": write_json,
               "auc": plot_auc, "examples": plot_examples}
    return {key: writers[key](diagnosis, directory / name) for key, name in FILES.items()}
