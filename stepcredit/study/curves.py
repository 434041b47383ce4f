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


def plot_curves(out: str, path: str | None = None, *, metric: str = "rollout/success",
                window: int = 5) -> str | None:
    """Writes the curves (one panel per environment) to `path` (default
    `<out>/curves.png`); None when no run has logged an iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(out, metric=metric, window=window)
    if not data:
        return None
    path = path or os.path.join(out, "curves.png")
    figure, axes = plt.subplots(1, len(data), figsize=(4.5 * len(data), 3.6), squeeze=False)
    for axis, (env, methods) in zip(axes[0], data.items()):
        for method, values in methods.items():
            steps = np.arange(values.shape[1])
            line, = axis.plot(steps, values.mean(axis=0), label=f"{method} ({len(values)})")
            axis.fill_between(steps, values.min(axis=0), values.max(axis=0),
                              color=line.get_color(), alpha=0.2, linewidth=0)
        axis.set_title(env)
        axis.set_xlabel("iteration")
        axis.set_ylabel(f"{metric}, {window}-iteration mean")
        axis.legend(fontsize=7, title="method (seeds)", title_fontsize=7)
    figure.tight_layout()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    plt.close(figure)
    return path
