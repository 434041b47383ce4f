"""One job of a sweep, in its own process: `python -m stepcredit.study.worker STUDY JOB OUT CORES`.

A job is one training run of the study (JOB is its run id) or, for a study with a
[diagnose] table, its diagnosis (JOB is `diagnose`), written to `<OUT>/diagnose/`.

The sweep starts one such process per run, so a crash (a signal, an out-of-memory
kill) ends that run only, and each process is pinned to its cores (CORES) before
JAX starts its thread pools. The run trains in `<OUT>/runs/<RUN>/`, continuing from its newest
checkpoint when a checkpointed run is already there, then evaluates its final
policy greedily on each test split and writes `<OUT>/records/<RUN>.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
import traceback

from stepcredit.compilation_cache import use_compilation_cache
from stepcredit.study.records import DONE, FAILED, run_dir, write_record
from stepcredit.study.spec import Run, Study, load_study

DIAGNOSIS = "diagnose"


def run_config(run: Run, out: str):
    """The TrainConfig that `run` trains with in the sweep directory `out`: its study
    configuration logging to `<out>/runs/<run_id>/`, with the prompt budget fitted where the
    study leaves it open."""
    from stepcredit.train.build import with_fitted_prompt_budget

    config = dataclasses.replace(run.config, logdir=run_dir(out, run.run_id))
    return with_fitted_prompt_budget(config) if run.fit_prompt_budget else config


def evaluated_splits(run: Run, config) -> tuple[str, ...]:
    """The splits `run` is tested on: the study's `eval_splits`, else the environment's
    held-out split (`stepcredit.train.evaluate.test_split`: "seen" on ALFWorld)."""
    if run.eval_splits:
        return tuple(run.eval_splits)
    from stepcredit.train.build import make_env
    from stepcredit.train.evaluate import test_split

    probe = make_env(config, "train")
    try:
        return (test_split(probe),)
    finally:
        probe.close()


def train_run(run: Run, out: str, *, log=print) -> dict:
    """Trains `run` in `<out>/runs/<run_id>/` (resuming its checkpoint) and returns its
    "done" record: final evaluation per split, last training batch, and the wall time of
    this invocation (a resumed run's earlier time is not in it)."""
    from stepcredit.train.evaluate import evaluate
    from stepcredit.train.metrics import read_metrics
    from stepcredit.train.trainer import Trainer

    began = time.perf_counter()
    logdir = run_dir(out, run.run_id)
    config = run_config(run, out)
    # A run directory without checkpoints (a copy that kept only metrics and config.json)
    # starts over: there is nothing to resume from.
    checkpoints = os.path.join(logdir, "checkpoints")
    resume = (os.path.exists(os.path.join(logdir, "config.json"))
              and os.path.isdir(checkpoints) and bool(os.listdir(checkpoints)))
    trainer = Trainer(config, log=log)
    trainer.run(resume=resume, overwrite=not resume)
    final = {split: evaluate(trainer.graphdef, trainer.state.policy, trainer.tokenizer, config,
                             num_tasks=run.eval_tasks, temperature=config.eval_temperature,
                             split=split)
             for split in evaluated_splits(run, config)}
    metrics = [m for m in read_metrics(logdir) if m["iteration"] >= 0]
    last = metrics[-1] if metrics else {}
    return {"run": run.run_id, "status": DONE, "env": run.env, "method": run.method,
            "simulator": config.env, "estimator": config.estimator, "seed": run.seed,
            "iterations": len(metrics), "resumed": resume,
            "eval": final, "eval_tasks": run.eval_tasks,
            "train_success_last": last.get("rollout/success"),
            "seconds": time.perf_counter() - began, "config": config.to_json()}


def diagnose_study(study: Study, out: str) -> dict:
    """Runs the study's diagnosis into `<out>/diagnose/` and returns its "done" record."""
    from stepcredit.diagnose.report import write_report
    from stepcredit.diagnose.run import diagnose

    began = time.perf_counter()
    diagnosis = diagnose(study.diagnosis(), progress=False)
    write_report(diagnosis, os.path.join(out, "diagnose"))
    return {"run": DIAGNOSIS, "status": DONE, "kind": "diagnosis",
            "seconds": time.perf_counter() - began}


def failed_record(study: Study, job: str, error: str) -> dict:
    """The record of a job that raised or was killed; `error` says how."""
    if job == DIAGNOSIS:
        return {"run": DIAGNOSIS, "status": FAILED, "kind": "diagnosis", "error": error}
    run = study.run(job)
    return {"run": run.run_id, "status": FAILED, "env": run.env, "method": run.method,
            "estimator": run.config.estimator, "seed": run.seed, "error": error}


def exit_with_parent(poll_seconds: float = 1.0) -> None:
    """Ends this process soon after the sweep that started it dies (even by SIGKILL), so
    that no orphan keeps training in a directory that the next sweep trains in."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(argv: list[str] | None = None) -> int:
    """`STUDY JOB OUT [CORES]`: CORES (comma-separated) is the CPU affinity to run with,
    set before JAX starts its thread pools, which it sizes by the affinity."""
    study_path, job, out, *cores = argv if argv is not None else sys.argv[1:]
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cores[0].split(",")})
    exit_with_parent()
    use_compilation_cache()
    study = load_study(study_path)
    log = functools.partial(print, flush=True)
    try:
        record = (diagnose_study(study, out) if job == DIAGNOSIS
                  else train_run(study.run(job), out, log=log))
    except Exception as error:  # noqa: BLE001 - any failure ends this job only, recorded
        traceback.print_exc()
        write_record(out, failed_record(study, job, f"{type(error).__name__}: {error}"))
        return 1
    write_record(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
