"""Runs a study's grid in parallel worker processes, resumably.

`sweep(study_path, out, workers=N)` starts one process per run
(`stepcredit.study.worker`), at most `workers` at a time (and no more than the
jobs left), each pinned to `cores // processes` cores of its own (CPU affinity,
which sizes XLA's thread pools) so that they do not oversubscribe the CPU. A run
with a "done" record is skipped; a run interrupted earlier resumes from its
checkpoints; a run whose process fails or is killed gets a "failed" record with
the error, and the others go on (the next sweep retries it). One progress bar
counts the training iterations of the whole sweep. Each run's output goes to
`<out>/runs/<run_id>/log.txt`; the study file is copied to `<out>/study.toml`,
and a sweep into a directory holding another study's results is refused, unless
`amend=True` says the study is an edit of that one (the jobs it would run differently
are moved aside, the others kept).
`reuse=[other_out]` first copies the finished runs another sweep shares with this
study (same run id, same resolved configuration) instead of training them again.
`only=["webshop-*"]` runs the jobs whose ids match one of the shell patterns and
leaves the others as they stand (a study's cheap runs before its costly ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from stepcredit.data.write import atomic_path
from stepcredit.study.records import (DONE, FAILED, read_record, record_path, run_dir,
                                      write_record)
from stepcredit.study.spec import Study, load_study
from stepcredit.study.worker import DIAGNOSIS, evaluated_splits, failed_record, run_config

_POLL_SECONDS = 0.5
_LOG_TAIL_LINES = 15


@dataclasses.dataclass(frozen=True)
class SweepSummary:
    """What a sweep did: run ids finished before it (skipped), finished now, failed now."""

    skipped: tuple[str, ...]
    finished: tuple[str, ...]
    failed: tuple[str, ...]


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(_affinity())


def worker_plan(pending: int, workers: int | None = None, threads: int | None = None,
                cores: int | None = None) -> tuple[int, int]:
    """`(processes at a time, threads each)` for `pending` jobs on `cores` cores.

    The processes are `workers` (default: the cores), but never more than the
    pending jobs, so that a sweep with fewer jobs left than workers gives their
    cores to the jobs it runs; each runs `threads` threads (default: the cores
    shared among the processes, at least one).
    """
    cores = cores or available_cores()
    workers = cores if workers is None else workers
    if workers < 1:
        raise ValueError(f"--workers {workers}: it must be >= 1")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: it must be >= 1")
    workers = max(1, min(workers, pending))
    return workers, threads or max(1, cores // workers)


def worker_environment(threads: int) -> dict[str, str]:
    """The environment of a worker process meant to run `threads` CPU threads: OpenMP's
    and BLAS's pools sized to it, and XLA's Eigen pool off for one thread. (XLA sizes its
    own pools by the CPU affinity that `worker_cores` sets.)"""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_cpu_multi_thread_eigen")]
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    env["XLA_FLAGS"] = " ".join(flags)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    return env


def worker_cores(slots: int, threads: int, cores: Sequence[int] | None = None
                 ) -> list[tuple[int, ...]]:
    """The cores of each worker slot: `threads` consecutive ones of the available cores,
    slot after slot (wrapping round where slots x threads exceeds them), so that two workers
    share a core only when asked to oversubscribe."""
    cores = sorted(cores if cores is not None else _affinity())
    return [tuple(cores[(slot * threads + i) % len(cores)] for i in range(threads))
            for slot in range(slots)]


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def claim_output(study: Study, out: str, *, amend: bool = False) -> tuple[str, ...]:
    """Makes `out` this study's output directory, or refuses one holding another study's.

    With `amend`, a directory holding an earlier version of the study (another fingerprint)
    is taken over: its jobs that this study no longer runs the same way are moved aside
    (`supersede_changed`) and the rest are kept, finished or resumable. Returns the ids of
    the jobs moved aside.
    """
    os.makedirs(out, exist_ok=True)
    marker = os.path.join(out, "study.json")
    identity = {"name": study.name, "fingerprint": study.fingerprint()}
    moved: tuple[str, ...] = ()
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            held = json.load(f)
        if held == identity:
            return moved
        if not amend:
            raise ValueError(f"--out {out} holds the results of another study ({held['name']}, "
                             f"fingerprint {held['fingerprint']}; this one: {study.name}, "
                             f"{identity['fingerprint']}): its runs would be mixed; choose "
                             "another directory, or pass --amend if this study is an edit of "
                             "that one")
        moved = supersede_changed(study, out, held["fingerprint"])
    for name, text in (("study.toml", study.source), ("study.json", json.dumps(identity))):
        with atomic_path(os.path.join(out, name)) as temporary, \
                open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
    return moved


def supersede_changed(study: Study, out: str, old_fingerprint: str) -> tuple[str, ...]:
    """Moves aside, to `<out>/superseded/<old_fingerprint>/`, what `study` would not continue
    of each job in `out`; returns the ids of the jobs touched.

    Records and run directories are renamed whole, so nothing is lost. A job goes aside
    with its run directory when the study has no such run; when its configuration
    differs from the one the study now resolves (`TrainConfig.differences`, the log
    directory aside) in a field that a resumed run may not change (`RESUMABLE_CHANGES`);
    when it finished with other evaluation splits or task counts; and, for the diagnosis,
    when its settings changed. A finished run whose changes a resumed run may make (more
    iterations, say) loses only its record: the sweep resumes it from its checkpoints.
    A job with neither record nor configuration written yet is left to start over.
    """
    from stepcredit.train.config import RESUMABLE_CHANGES, TrainConfig

    def what_goes(job_id: str) -> tuple[str, ...]:
        everything = (record_path(out, job_id), run_dir(out, job_id))
        record = read_record(out, job_id) or {}
        if job_id == DIAGNOSIS:
            earlier = load_study(os.path.join(out, "study.toml")).diagnosis()
            return ((*everything, os.path.join(out, DIAGNOSIS))
                    if repr(earlier) != repr(study.diagnosis()) else ())
        if job_id not in runs:
            return everything
        run = runs[job_id]
        saved = os.path.join(run_dir(out, job_id), "config.json")
        if record.get("config"):
            text = record["config"]
        elif os.path.exists(saved):
            with open(saved, encoding="utf-8") as f:
                text = f.read()
        else:
            return ()
        config = run_config(run, os.path.abspath(out))
        differences = TrainConfig.from_json(text).differences(config, ignore=("logdir",))
        if any(d.split(":")[0] not in RESUMABLE_CHANGES for d in differences):
            return everything
        if record.get("status") != DONE:
            return ()
        if not _tested_as_planned(record, run, config):
            return everything
        return everything[:1] if differences else ()

    runs = {run.run_id: run for run in study.runs()}
    held = set()
    for directory, suffix in (("records", ".json"), ("runs", "")):
        path = os.path.join(out, directory)
        if os.path.isdir(path):
            held |= {name[:len(name) - len(suffix)] for name in os.listdir(path)
                     if name.endswith(suffix) and not name.endswith(".partial")}
    aside = os.path.join(out, "superseded", old_fingerprint)
    touched = []
    for job_id in sorted(held):
        going = [path for path in what_goes(job_id) if os.path.exists(path)]
        for source in going:
            target = os.path.join(aside, os.path.relpath(source, out))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
        if going:
            touched.append(job_id)
    return tuple(touched)


@dataclasses.dataclass(frozen=True)
class Job:
    """One process of a sweep: a training run (its id) or the diagnosis (`DIAGNOSIS`)."""

    job_id: str
    iterations: int  # training iterations it counts on the progress bar (0: the diagnosis)


def jobs(study: Study) -> list[Job]:
    """The diagnosis first (it takes one process while the runs take the rest), then the runs."""
    found = [Job(DIAGNOSIS, 0)] if study.diagnose is not None else []
    return found + [Job(run.run_id, run.config.iterations) for run in study.runs()]


def select_jobs(every: Sequence[Job], only: Sequence[str]) -> list[Job]:
    """The jobs whose ids match one of the shell patterns `only` (all of them when empty).

    Raises:
      ValueError: a pattern matches no job of the study.
    """
    for pattern in only:
        if not any(fnmatch.fnmatchcase(j.job_id, pattern) for j in every):
            raise ValueError(f"only: {pattern!r} matches none of the study's jobs "
                             f"({', '.join(j.job_id for j in every[:4])}, ...)")
    return [j for j in every if not only or any(fnmatch.fnmatchcase(j.job_id, p) for p in only)]


def _iterations_done(out: str, job: Job) -> int:
    """Training iterations the run has logged (its metrics file's rows from 0 on)."""
    path = os.path.join(run_dir(out, job.job_id), "metrics.jsonl")
    if not job.iterations or not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        done = sum(1 for line in f if line.startswith('{"iteration": ') and
                   not line.startswith('{"iteration": -'))
    return min(done, job.iterations)


def _tail(path: str, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).strip()
    except FileNotFoundError:
        return ""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _tested_as_planned(record: dict, run, config) -> bool:
    """Whether a finished run's record holds the test the study plans for `run`: as many
    tasks, on the same splits."""
    return (record.get("eval_tasks") == run.eval_tasks
            and sorted(record.get("eval", {})) == sorted(evaluated_splits(run, config)))


def reuse_runs(study: Study, out: str, source: str) -> tuple[str, ...]:
    """Copies into `out` the finished runs of another sweep's directory `source` that this
    study would train the same way; returns their run ids.

    A run is copied when `source` holds a "done" record under the same run id whose resolved
    configuration equals the one this study's run trains with, but for the directory it logs
    to (so a fitted prompt budget must come out the same; a field the record predates counts
    as its default, as when a checkpoint is resumed), whose test was the one this study plans
    (as many tasks, the same splits), and `out` holds nothing of that run yet
    (no record, no run directory: an interrupted run there is resumed, not replaced).
    Its run directory comes without checkpoints; its record says where it came from
    (`reused_from`) and logs to its new place.
    """
    from stepcredit.train.config import TrainConfig

    copied = []
    for run in study.runs():
        held = read_record(source, run.run_id)
        target = run_dir(out, run.run_id)
        if (held is None or held.get("status") != DONE or read_record(out, run.run_id)
                or os.path.exists(target)):
            continue
        config = run_config(run, os.path.abspath(out))
        if (TrainConfig.from_json(held["config"]).differences(config, ignore=("logdir",))
                or not _tested_as_planned(held, run, config)):
            continue
        if os.path.isdir(run_dir(source, run.run_id)):  # a record alone is a finished run too
            partial = target + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(run_dir(source, run.run_id), partial,
                            ignore=shutil.ignore_patterns("checkpoints"))
            os.rename(partial, target)
        write_record(out, {**held, "config": config.to_json(), "reused_from": source})
        copied.append(run.run_id)
    return tuple(copied)


def sweep(study_path: str, out: str, *, workers: int | None = None, threads: int | None = None,
          progress: bool = True, note: Callable[[str], None] | None = None,
          reuse: Sequence[str] = (), amend: bool = False,
          only: Sequence[str] = ()) -> SweepSummary:
    """Runs every unfinished job of the study in `study_path`; returns what it did.

    Args:
      study_path: the study file (`stepcredit.study.spec`).
      out: the sweep's directory (records/, runs/, diagnose/, study.toml).
      workers: processes at a time (default: the cores; never more than the pending
        jobs, whose threads then share the cores, `worker_plan`).
      threads: CPU threads per process (default: cores // processes, at least 1).
      progress: show a progress bar over the sweep's training iterations.
      note: where one-line messages go (a job finished or failed; default: above the bar).
      reuse: other sweeps' directories whose finished runs this study shares
        (`reuse_runs`): copied, not trained again.
      amend: `out` may hold an earlier version of this study: its jobs that the study
        would no longer continue as they stand are moved aside (`supersede_changed`).
      only: shell patterns of job ids (`select_jobs`); the sweep runs only the jobs
        that match one (the diagnosis's id is "diagnose"); empty: all of them.
    """
    from tqdm import tqdm

    note = note or tqdm.write
    study = load_study(study_path)
    selected = select_jobs(jobs(study), only)
    os.makedirs(out, exist_ok=True)
    with _exclusive(out), _terminate_as_exit():
        moved = claim_output(study, out, amend=amend)
        if moved:
            note(f"{len(moved)} job(s) the edited study runs differently moved aside to "
                 f"{os.path.join(out, 'superseded')}: {', '.join(moved)}")
        for source in reuse:
            copied = reuse_runs(study, out, source)
            note(f"{len(copied)} finished run(s) with the same configuration copied from {source}")
        return _sweep(study, selected, out, workers=workers, threads=threads, progress=progress,
                      note=note)


def _sweep(study: Study, every: Sequence[Job], out: str, *, workers, threads, progress,
           note) -> SweepSummary:
    from tqdm import tqdm

    skipped = tuple(j.job_id for j in every
                    if (read_record(out, j.job_id) or {}).get("status") == DONE)
    queue = [j for j in every if j.job_id not in skipped]
    workers, threads = worker_plan(len(queue), workers, threads)
    env = worker_environment(threads)
    free_slots = list(enumerate(worker_cores(workers, threads)))
    note(f"{study.name}: {len(every)} jobs, {len(skipped)} already done, {len(queue)} to run "
         f"with {workers} worker(s) x {threads} thread(s); logs in {os.path.join(out, 'runs')}")
    bar = tqdm(total=sum(j.iterations for j in every), desc=f"sweep {study.name}", unit="it",
               disable=not progress, dynamic_ncols=True, file=sys.stderr)
    bar.update(sum(j.iterations for j in every if j.job_id in skipped))
    running: dict[str, tuple[Job, subprocess.Popen, tuple[int, tuple[int, ...]]]] = {}
    counted: dict[str, int] = {}
    finished: list[str] = []
    failed: list[str] = []
    status = ""
    try:
        while queue or running:
            while queue and len(running) < workers:
                job, slot = queue.pop(0), free_slots.pop(0)
                running[job.job_id] = (job, _start(job, out, env, slot[1]), slot)
            time.sleep(_POLL_SECONDS)
            for job_id, (job, process, slot) in list(running.items()):
                code = process.poll()
                done_now = job.iterations if code is not None else _iterations_done(out, job)
                bar.update(done_now - counted.get(job_id, 0))
                counted[job_id] = done_now
                if code is None:
                    continue
                del running[job_id]
                free_slots.append(slot)
                record = read_record(out, job_id)
                if code == 0 and record and record["status"] == DONE:
                    finished.append(job_id)
                    note(f"{job_id}: done")
                    continue
                if not record or record["status"] != FAILED:
                    log = os.path.join(run_dir(out, job_id), "log.txt")
                    record = failed_record(study, job_id,
                                           f"{_exit_text(code)}; log tail:\n{_tail(log)}")
                    write_record(out, record)
                failed.append(job_id)
                note(f"{job_id}: failed ({record['error'].splitlines()[0]}); the others go on, "
                     "and the next sweep retries it")
            now = (f"{len(skipped) + len(finished)}/{len(every)} jobs done"
                   + (f", {len(failed)} failed" if failed else ""))
            if now != status:
                bar.set_postfix_str(now)
                status = now
    except BaseException:
        for _, process, _ in running.values():
            process.terminate()
        for _, process, _ in running.values():
            process.wait()
        raise
    finally:
        bar.close()
    return SweepSummary(skipped=skipped, finished=tuple(finished), failed=tuple(failed))


@contextlib.contextmanager
def _exclusive(out: str):
    """Holds `<out>/.lock` for the sweep: a second sweep into `out` would train the same
    runs in the same directories at once."""
    import fcntl

    with open(os.path.join(out, ".lock"), "w", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"--out {out}: another sweep is running there") from None
        yield


@contextlib.contextmanager
def _terminate_as_exit():
    """SIGTERM raises SystemExit in the sweep, so that it stops its workers first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start(job: Job, out: str, env: dict[str, str], cores: tuple[int, ...]) -> subprocess.Popen:
    """The job's worker process on `cores`, reading the study from `<out>/study.toml` (the
    copy that `claim_output` checked) so that an edit to the original mid-sweep changes
    nothing."""
    directory = run_dir(out, job.job_id)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "log.txt"), "a", encoding="utf-8") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "stepcredit.study.worker",
             os.path.join(os.path.abspath(out), "study.toml"), job.job_id, os.path.abspath(out),
             ",".join(map(str, cores))],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
