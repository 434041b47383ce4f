"""Learning curves of a sweep: per environment, one line per method with a band over seeds.

The line is the mean over seeds of the training batch's success at each
iteration, smoothed by a trailing moving average of `window` iterations (a
batch of 8 tasks x 8 rollouts is noisy); the band spans the seeds' minimum to
maximum of the smoothed curves, so one seed's luck shows as width.
"""

from __future__ import annotations

import os

import numpy as np

from stepcredit.data.write import atomic_path
from stepcredit.study.records import DONE, read_record, run_dir
from stepcredit.study.spec import load_study


def smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average `[T] -> [T]`: entry t averages values[max(0, t-window+1) : t+1]."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"smoothed: values must be [T], got shape {values.shape}")
    if window < 1:
        raise ValueError(f"smoothed: window must be >= 1, got {window}")
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def curves(out: str, *, metric: str = "rollout/success", window: int = 5
           ) -> dict[str, dict[str, np.ndarray]]:
    """env -> method -> `[S, T]` smoothed `metric` per seed and iteration, over the
    iterations every finished seed reached (runs without a "done" record, still going or
    failed, are left out)."""
    from stepcredit.train.metrics import read_metrics

    study = load_study(os.path.join(out, "study.toml"))
    found: dict[str, dict[str, np.ndarray]] = {}
    for env in study.envs:
        for method in study.methods:
            per_seed = []
            for run in study.runs():
                if run.env != env or run.method != method:
                    continue
                path = run_dir(out, run.run_id)
                if ((read_record(out, run.run_id) or {}).get("status") != DONE
                        or not os.path.exists(os.path.join(path, "metrics.jsonl"))):
                    continue
                values = [m[metric] for m in read_metrics(path)
                          if m["iteration"] >= 0 and m.get(metric) is not None]
                if values:
                    per_seed.append(smoothed(np.array(values), window))
            if per_seed:
                length = min(len(v) for v in per_seed)
                found.setdefault(env, {})[method] = np.stack([v[:length] for v in per_seed])
    return found


# Ten colours, then the same ten dashed, then dotted: a study's twenty-odd methods stay
# apart where a colour cycle alone repeats after ten.
_COLOURS = 10
_DASHES = ("-", "--", ":", "-.")


def line_styles(methods: list[str]) -> dict[str, dict[str, object]]:
    """method -> matplotlib line keywords (`color`, `linestyle`, `linewidth`), a distinct
    colour and dash pair for each of up to 40 methods, the same method styled alike in
    every panel and in the legend."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    return {method: {"color": palette(i % _COLOURS),
                     "linestyle": _DASHES[i // _COLOURS % len(_DASHES)], "linewidth": 1.2}
            for i, method in enumerate(methods)}


def plot_curves(out: str, path: str | None = None, *, metric: str = "rollout/success",
                window: int = 5) -> str | None:
    """Writes the curves (one panel per environment, one legend below them all) to `path`
    (default `<out>/curves.png`); None when no run has logged an iteration. A legend
    entry gives the method's seeds, per panel (`3/3/2`) where the panels differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    data = curves(out, metric=metric, window=window)
    if not data:
        return None
    path = path or os.path.join(out, "curves.png")
    methods = list(dict.fromkeys(method for found in data.values() for method in found))
    styles = line_styles(methods)
    columns = min(len(methods), 6)
    legend_rows = -(-len(methods) // columns)
    legend_height = 0.15 + 0.17 * legend_rows
    height = 3.6 + legend_height
    figure, axes = plt.subplots(1, len(data), figsize=(4.5 * len(data), height), squeeze=False)
    for axis, (env, found) in zip(axes[0], data.items()):
        for method, values in found.items():
            steps = np.arange(values.shape[1])
            axis.plot(steps, values.mean(axis=0), **styles[method])
            axis.fill_between(steps, values.min(axis=0), values.max(axis=0),
                              color=styles[method]["color"], alpha=0.12, linewidth=0)
        axis.set_title(env)
        axis.set_xlabel("iteration")
        axis.set_ylabel(f"{metric}, {window}-iteration mean")
    handles, labels = [], []
    for method in methods:
        seeds = [len(found[method]) if method in found else 0 for found in data.values()]
        handles.append(Line2D([], [], **styles[method]))
        count = str(seeds[0]) if len(set(seeds)) == 1 else "/".join(map(str, seeds))
        labels.append(f"{method} ({count})")
    figure.legend(handles, labels, loc="lower center", ncol=columns, fontsize=7, frameon=False,
                  title="method (seeds)", title_fontsize=7)
    figure.tight_layout(rect=(0, legend_height / height, 1, 1))
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    plt.close(figure)
    return path
