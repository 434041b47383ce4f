"""A sweep's table: success over seeds with confidence intervals, beside the diagnosis.

For each (environment, test split) column and method: the mean, standard
deviation and Student-t 95% confidence interval of the final test success over
seeds,

    mean +- t_{0.975, n-1} * sd / sqrt(n),    sd with n - 1 degrees of freedom,

(no interval from one seed); the best method of a column is marked only where
its interval lies wholly above every other method's. Beside them, from the
sweep's diagnosis (`<out>/diagnose/`), the method's estimator graded against
the simulator's ground truth: AUC and blame localisation with their bootstrap
intervals (none for a method that sets its own hyperparameters, `set`: the
diagnosis grades each estimator at its defaults). Then the published success
of the same method in other papers (`stepcredit.study.published`), in separate
columns: other models and real environments, so only orderings compare.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from typing import Any, Sequence

from stepcredit.data.write import atomic_path
from stepcredit.study.published import SOURCES, published
from stepcredit.study.records import DONE, load_records
from stepcredit.study.spec import Study, load_study

DIAGNOSIS_METRICS = ("auc", "blame_localisation")


@dataclasses.dataclass(frozen=True)
class Summary:
    """A metric over seeds: count, mean, sample standard deviation, 95% t-interval."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @property
    def has_interval(self) -> bool:
        return self.n > 1 and math.isfinite(self.low)


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample standard deviation and Student-t 95% interval of `values` [n].

    Raises:
      ValueError: `values` is empty or holds a non-finite value.
    """
    from scipy import stats

    values = [float(v) for v in values]
    if not values:
        raise ValueError("summarize: values is empty (no seed finished)")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"summarize: values {values} hold a non-finite value")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return Summary(1, mean, math.nan, math.nan, math.nan)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half)


def separated_best(summaries: dict[str, Summary]) -> str | None:
    """The label with the highest mean if its interval lies above every other's, else None."""
    if len(summaries) < 2:
        return None
    best = max(summaries, key=lambda label: summaries[label].mean)
    others = [s for label, s in summaries.items() if label != best]
    if not summaries[best].has_interval or not all(s.has_interval for s in others):
        return None
    return best if all(summaries[best].low > s.high for s in others) else None


def _splits(study: Study, env: str, records: Sequence[dict]) -> list[str]:
    """The env's test splits: those the study names, else those its records hold."""
    named = list(study.envs[env].get("eval_splits", []))
    if named:
        return named
    found: list[str] = []
    for record in records:
        if record.get("env") == env and record["status"] == DONE:
            found += [split for split in record["eval"] if split not in found]
    return found


def _diagnosis(out: str) -> dict[tuple[str, str, str], tuple[float, float, float]]:
    """(simulator, estimator, metric) -> (estimate, low, high) of the sweep's diagnosis."""
    path = os.path.join(out, "diagnose", "diagnose.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        scores = json.load(f)["scores"]
    return {(s["env"], s["estimator"], s["metric"]): tuple(
        math.nan if s[k] is None or isinstance(s[k], str) else float(s[k])
        for k in ("estimate", "low", "high")) for s in scores if s["metric"] in DIAGNOSIS_METRICS}


def build_table(out: str) -> dict[str, Any]:
    """The table of the sweep in `out` as plain data.

    Returns:
      `{"study": name, "columns": [...], "failed": {run: error}, "missing": [run],
      "diagnosed": bool}`; each column `{"title", "env", "simulator", "split",
      "rows"}`, each row `{"method", "estimator", "success": Summary | None,
      "score": Summary | None, "best": bool, "diagnosis": {metric: (estimate,
      low, high)}, "published": {source label: success}}`.
    """
    study = load_study(os.path.join(out, "study.toml"))
    records = load_records(out)
    by_run = {r["run"]: r for r in records}
    diagnosis = _diagnosis(out)
    columns = []
    for env in study.envs:
        simulator = study.simulator(env)
        splits = _splits(study, env, records)
        for split in splits:
            rows = []
            for method, table in study.methods.items():
                done = [by_run[run.run_id] for run in study.runs()
                        if run.env == env and run.method == method
                        and by_run.get(run.run_id, {}).get("status") == DONE]
                evals = [r["eval"][split] for r in done if split in r["eval"]]
                estimator = table["estimator"]
                # The diagnosis grades each estimator at its defaults: a method that sets its
                # own hyperparameters is another credit, which it did not grade.
                graded = not table.get("set")
                rows.append({
                    "method": method, "estimator": estimator,
                    "success": summarize([e["success"] for e in evals]) if evals else None,
                    "score": summarize([e["score"] for e in evals]) if evals else None,
                    "diagnosis": {m: diagnosis[(simulator, estimator, m)]
                                  for m in DIAGNOSIS_METRICS
                                  if graded and (simulator, estimator, m) in diagnosis},
                    "published": published(table.get("published"), simulator, split)})
            best = separated_best({r["method"]: r["success"] for r in rows if r["success"]})
            for row in rows:
                row["best"] = row["method"] == best
            columns.append({"title": env if len(splits) == 1 else f"{env} ({split})",
                            "env": env, "simulator": simulator, "split": split, "rows": rows})
    return {"study": study.name, "description": study.description, "columns": columns,
            "failed": {r["run"]: r["error"] for r in records if r["status"] != DONE},
            "missing": [run.run_id for run in study.runs() if run.run_id not in by_run],
            "diagnosed": bool(diagnosis), "seeds": list(study.seeds)}


def _summary_text(summary: Summary | None) -> str:
    """`mean ± sd [low, high]`, the interval clipped to [0, 1], the range of success and
    score (the CSV keeps the unclipped bounds)."""
    if summary is None:
        return "-"
    if not summary.has_interval:
        return f"{summary.mean:.2f} (1 seed)"
    low, high = max(summary.low, 0.0), min(summary.high, 1.0)
    return f"{summary.mean:.2f} ± {summary.std:.2f} [{low:.2f}, {high:.2f}]"


def _score_text(score: tuple[float, float, float] | None) -> str:
    if score is None or not math.isfinite(score[0]):
        return "-"
    estimate, low, high = score
    return f"{estimate:.2f} [{low:.2f}, {high:.2f}]"


def markdown(table: dict[str, Any]) -> str:
    """The table in Markdown: one section per (environment, split) column."""
    lines = [f"# Study {table['study']}", ""]
    if table["description"]:
        lines += [table["description"], ""]
    lines += ["Test success of the final policy (greedy), mean ± sd [95% t-interval, clipped to "
              "[0, 1]] over "
              f"seeds {', '.join(map(str, table['seeds']))}; **bold**: the best, only where its "
              "interval lies above every other method's."
              + (" AUC and blame localisation: the method's estimator graded against the "
                 "simulator's ground truth (`stepcredit diagnose`), with bootstrap intervals."
                 if table["diagnosed"] else "")
              + " Published columns: other papers' success on the real environments with "
                "language models; compare orderings, not values.", ""]
    for column in table["columns"]:
        sources = [s.label for s in SOURCES if any(s.label in r["published"]
                                                   for r in column["rows"])]
        header = ["method", "estimator", "seeds", "test success", "test score"]
        if table["diagnosed"]:
            header += ["AUC", "blame localisation"]
        header += [f"published: {label}" for label in sources]
        lines += [f"## {column['title']}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        for row in column["rows"]:
            success = _summary_text(row["success"])
            cells = [row["method"], f"`{row['estimator']}`",
                     str(row["success"].n if row["success"] else 0),
                     f"**{success}**" if row["best"] else success, _summary_text(row["score"])]
            if table["diagnosed"]:
                cells += [_score_text(row["diagnosis"].get(m)) for m in DIAGNOSIS_METRICS]
            cells += [f"{row['published'][label]:.2f}" if label in row["published"] else "-"
                      for label in sources]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    notes = [f"- {s.label}: {s.note}." for s in SOURCES
             if any(s.label in r["published"] for c in table["columns"] for r in c["rows"])]
    if notes:
        lines += ["Published sources:", ""] + notes + [""]
    if table["failed"]:
        lines += ["Failed runs (rerun the sweep to retry them):", ""] + [
            f"- {run}: {error.splitlines()[0]}" for run, error in sorted(table["failed"].items())
        ] + [""]
    if table["missing"]:
        lines += [f"Not yet run: {', '.join(table['missing'])}.", ""]
    return "\n".join(lines)


def csv_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (column, method): every number of the Markdown table, unrounded."""
    rows = []
    for column in table["columns"]:
        for row in column["rows"]:
            out: dict[str, Any] = {"study": table["study"], "env": column["env"],
                                   "simulator": column["simulator"], "split": column["split"],
                                   "method": row["method"], "estimator": row["estimator"]}
            for metric in ("success", "score"):
                summary = row[metric]
                out[f"{metric}_seeds"] = summary.n if summary else 0
                for field in ("mean", "std", "low", "high"):
                    out[f"{metric}_{field}"] = getattr(summary, field) if summary else math.nan
            out["best"] = row["best"]
            for metric in DIAGNOSIS_METRICS:
                estimate, low, high = row["diagnosis"].get(metric, (math.nan,) * 3)
                out.update({metric: estimate, f"{metric}_low": low, f"{metric}_high": high})
            for source in SOURCES:
                out[f"published: {source.label}"] = row["published"].get(source.label, math.nan)
            rows.append(out)
    return rows


def write_table(out: str, *, directory: str | None = None) -> dict[str, str]:
    """Writes `table.md` and `table.csv` (into `directory`, default `out`); returns paths."""
    table = build_table(out)
    directory = directory or out
    os.makedirs(directory, exist_ok=True)
    paths = {"md": os.path.join(directory, "table.md"), "csv": os.path.join(directory, "table.csv")}
    rows = csv_rows(table)
    with atomic_path(paths["md"]) as temporary, open(temporary, "w", encoding="utf-8") as f:
        f.write(markdown(table))
    with atomic_path(paths["csv"]) as temporary, \
            open(temporary, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["study"])
        writer.writeheader()
        writer.writerows(rows)
    return paths
