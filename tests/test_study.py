"""Studies, records, tables and curves (the sweep's processes are tested in tests/train)."""

import dataclasses
import glob
import json
import math
import os
import shutil
import statistics

import numpy as np
import pytest
from scipy import stats

from stepcredit.study import curves, records, spec, sweep, table

STUDY = """
name = "small"
seeds = [0, 1, 2]
[train]
iterations = 3
d_model = 16
[train.rollout]
action_format = "choice"
[train.loss]
kl_coef = 0.1
[envs.hotpotqa]
max_steps = 5
[envs.alfworld]
eval_splits = ["seen", "unseen"]
learning_rate = 1e-3
[methods.GRPO]
estimator = "grpo"
published = "grpo"
[methods.StepPO]
estimator = "step_gae"
set = { lam = 0.9 }
loss = { step_level_ratio = true }
learning_rate = 5e-4
published = "steppo"
[diagnose]
tasks = 2
"""


def _study(text=STUDY, tmp_path=None):
    if tmp_path is None:
        return spec.parse_study(__import__("tomllib").loads(text), source=text)
    path = tmp_path / "study.toml"
    path.write_text(text)
    return spec.load_study(path)


def test_runs_cross_envs_methods_and_seeds_with_overrides():
    study = _study()
    runs = study.runs()
    assert [r.run_id for r in runs[:4]] == ["hotpotqa-GRPO-s0", "hotpotqa-GRPO-s1",
                                            "hotpotqa-GRPO-s2", "hotpotqa-StepPO-s0"]
    assert len(runs) == 2 * 2 * 3
    steppo = study.run("alfworld-StepPO-s2")
    assert steppo.config.env == "alfworld" and steppo.config.seed == 2
    assert steppo.config.estimator == "step_gae"
    assert dict(steppo.config.estimator_config) == {"lam": 0.9}
    assert steppo.config.loss.step_level_ratio and steppo.config.loss.kl_coef == 0.1
    assert steppo.config.learning_rate == 5e-4  # the method's value wins over the env's
    assert study.run("alfworld-GRPO-s0").config.learning_rate == 1e-3
    assert study.run("hotpotqa-GRPO-s0").config.max_steps == 5
    assert steppo.eval_splits == ("seen", "unseen")
    assert study.run("hotpotqa-GRPO-s0").eval_splits == ()
    assert steppo.config.rollout.action_format == "choice" and steppo.fit_prompt_budget


def test_diagnosis_defaults_to_the_studys_simulators_and_estimators():
    diagnosis = _study().diagnosis()
    assert diagnosis.envs == ("hotpotqa", "alfworld")
    assert diagnosis.estimators == ("grpo", "step_gae")
    assert diagnosis.tasks == 2
    assert _study(STUDY.replace("[diagnose]\ntasks = 2\n", "")).diagnosis() is None


@pytest.mark.parametrize("change, message", [
    (("d_model = 16", "d_modle = 16"), r"\[train\]: unknown field 'd_modle'"),
    (("d_model = 16", "d_model = 'big'"), r"\[train\] d_model: expected int"),
    (("d_model = 16", "estimator = 'grpo'"), r"\[train\]: estimator is set per run"),
    (("kl_coef = 0.1", "kl_cof = 0.1"), r"\[train\] loss: unknown field 'kl_cof'"),
    (('estimator = "grpo"', 'estimator = "grpoo"'), r"\[methods.GRPO\]"),
    (('published = "grpo"', 'published = "grpoo"'),
     r"\[methods.GRPO\]: published='grpoo' is no row of the published numbers"),
    (("set = { lam = 0.9 }", "set = { lamb = 0.9 }"), r"\[methods.StepPO\]"),
    (("[envs.hotpotqa]", "[envs.hotpot]"), r"\[envs.hotpot\]: unknown environment 'hotpot'"),
    (("[methods.GRPO]", "[methods.'GR PO']"), r"label 'GR PO'"),
    (("seeds = [0, 1, 2]", "seeds = [0, 0]"), r"repeat a seed"),
    (("seeds = [0, 1, 2]", "seeds = []"), r"seeds must be a non-empty list"),
    (("seeds = [0, 1, 2]", "seeds = 3"), r"seeds must be a non-empty list of integers, got 3"),
    (('name = "small"', "name = 5"), r"name must be a string, got 5"),
    (("[methods.GRPO]\n", "[methods]\nGRPO = 'grpo'\n[methods.G]\n"),
     r"\[methods.GRPO\]: must be a table, got 'grpo'"),
    (("tasks = 2", "taks = 2"), r"\[diagnose\]: unknown field"),
    (("learning_rate = 5e-4", "learning_rate = true"), r"learning_rate: expected float"),
    (('eval_splits = ["seen", "unseen"]', 'eval_splits = ["seen", "unsen"]'),
     r"\[envs.alfworld\]: unknown eval split 'unsen'; alfworld has train, seen, unseen"),
    (('eval_splits = ["seen", "unseen"]', 'eval_tasks = "abc"'),
     r"\[envs.alfworld\]: eval_tasks='abc'; it must be an int >= 1"),
])
def test_a_bad_study_is_refused_naming_the_table(change, message):
    with pytest.raises(ValueError, match=message):
        _study(STUDY.replace(*change))


def test_a_methods_eval_tasks_win_over_its_environments():
    both = _study(STUDY.replace('eval_splits = ["seen", "unseen"]',
                                'eval_splits = ["seen", "unseen"]\neval_tasks = 8')
                  .replace('published = "steppo"', 'published = "steppo"\neval_tasks = 16'))
    assert both.run("alfworld-StepPO-s0").eval_tasks == 16
    assert both.run("alfworld-GRPO-s0").eval_tasks == 8


def test_a_value_where_a_table_belongs_is_named():
    with pytest.raises(ValueError, match=r"study \[envs\]: must be a table, got 3"):
        _study('envs = 3\n[methods.GRPO]\nestimator = "grpo"\n')


def test_two_runs_of_one_name_are_refused():
    clashing = """
name = "clash"
seeds = [0]
[envs.hotpotqa]
[envs.hotpotqa-GRPO]
env = "alfworld"
[methods.GRPO-s0]
estimator = "grpo"
[methods.s0]
estimator = "grpo"
"""
    with pytest.raises(ValueError, match="two runs would be named 'hotpotqa-GRPO-s0-s0'"):
        _study(clashing)


def test_a_study_file_that_is_not_toml_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        _study("name = ", tmp_path)


def test_the_shipped_studies_load():
    paths = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "experiments",
                                          "*.toml")))
    names = {os.path.basename(p) for p in paths}
    assert {"quick.toml", "main.toml"} <= names
    for path in paths:
        study = spec.load_study(path)
        assert study.runs(), path


def test_fingerprint_follows_the_runs():
    assert _study().fingerprint() == _study().fingerprint()
    assert _study().fingerprint() != _study(STUDY.replace("iterations = 3",
                                                          "iterations = 4")).fingerprint()


@pytest.mark.parametrize("marker", sorted(glob.glob(os.path.join(
    os.path.dirname(__file__), "..", "experiments", "results", "*", "study.json"))))
def test_committed_results_keep_their_study_fingerprint(marker):
    # A TrainConfig field added since the results were written must not orphan them: the next
    # sweep into the directory resumes instead of refusing it as another study's.
    name = os.path.basename(os.path.dirname(marker))
    with open(marker, encoding="utf-8") as f:
        held = json.load(f)
    study = spec.load_study(os.path.join(os.path.dirname(marker), "..", "..", f"{name}.toml"))
    assert held == {"name": study.name, "fingerprint": study.fingerprint()}
    qwen = dataclasses.replace(study.train, policy="qwen", model_dir="m")
    assert spec._fingerprinted(qwen) != spec._fingerprinted(study.train)


def test_summarize_is_the_student_t_interval():
    values = [0.5, 0.7, 0.65, 0.4]
    s = table.summarize(values)
    sem = statistics.stdev(values) / math.sqrt(4)
    assert s.mean == pytest.approx(statistics.mean(values))
    assert s.std == pytest.approx(statistics.stdev(values))
    assert (s.low, s.high) == pytest.approx(
        stats.t.interval(0.95, 3, loc=statistics.mean(values), scale=sem))
    two = table.summarize([0.5, 0.7])  # t_{0.975, 1} = 12.7062 (printed tables)
    assert (two.low, two.high) == pytest.approx((0.6 - 1.27062, 0.6 + 1.27062), abs=1e-4)
    one = table.summarize([0.3])
    assert one.mean == 0.3 and not one.has_interval
    with pytest.raises(ValueError, match="empty"):
        table.summarize([])
    with pytest.raises(ValueError, match="non-finite"):
        table.summarize([0.1, math.nan])


def test_the_best_is_marked_only_where_its_interval_separates_it():
    separated = {"a": table.summarize([0.9, 0.92, 0.91]), "b": table.summarize([0.1, 0.2, 0.15])}
    assert table.separated_best(separated) == "a"
    overlapping = {"a": table.summarize([0.9, 0.5, 0.7]), "b": table.summarize([0.6, 0.4, 0.5])}
    assert table.separated_best(overlapping) is None
    assert table.separated_best({"a": table.summarize([0.9]),
                                 "b": table.summarize([0.1])}) is None  # no interval
    assert table.separated_best({"a": separated["a"]}) is None


def _sweep_dir(tmp_path, successes, *, failed=(), diagnosis=True):
    """A sweep directory as `sweep` leaves it: the study, records and a diagnosis."""
    out = tmp_path / "out"
    study = _study(STUDY, tmp_path)
    sweep.claim_output(study, str(out))
    for run in study.runs():
        if run.run_id in failed:
            records.write_record(out, {"run": run.run_id, "status": records.FAILED,
                                       "env": run.env, "method": run.method,
                                       "error": "RuntimeError: boom\ntrace"})
            continue
        value = successes.get((run.env, run.method))
        if value is None:
            continue
        splits = run.eval_splits or ("test",)
        records.write_record(out, {
            "run": run.run_id, "status": records.DONE, "env": run.env, "method": run.method,
            "estimator": run.config.estimator, "seed": run.seed,
            "eval": {split: {"success": value[run.seed], "score": value[run.seed] / 2}
                     for split in splits}})
    if diagnosis:
        os.makedirs(out / "diagnose")
        scores = [{"env": env, "estimator": est, "metric": metric, "estimate": est_value,
                   "low": est_value - 0.05, "high": est_value + 0.05, "n": 10, "per_seed": []}
                  for env in ("hotpotqa", "alfworld") for est, est_value in
                  (("grpo", 0.6), ("step_gae", 0.7)) for metric in ("auc", "blame_localisation")]
        (out / "diagnose" / "diagnose.json").write_text(json.dumps({"scores": scores}))
        records.write_record(out, {"run": "diagnose", "status": records.DONE,
                                   "kind": "diagnosis"})
    return out


def test_table_summarises_seeds_marks_separated_best_and_adds_columns(tmp_path):
    out = _sweep_dir(tmp_path, {("hotpotqa", "GRPO"): [0.2, 0.25, 0.22],
                                ("hotpotqa", "StepPO"): [0.8, 0.82, 0.79],
                                ("alfworld", "GRPO"): [0.2, 0.6, 0.4],
                                ("alfworld", "StepPO"): [0.3, 0.5, 0.6]},
                     failed=())
    data = table.build_table(str(out))
    titles = [c["title"] for c in data["columns"]]
    assert titles == ["hotpotqa", "alfworld (seen)", "alfworld (unseen)"]
    hotpot = {r["method"]: r for r in data["columns"][0]["rows"]}
    assert hotpot["StepPO"]["best"] and not hotpot["GRPO"]["best"]
    assert hotpot["StepPO"]["success"].n == 3
    assert hotpot["StepPO"]["success"].mean == pytest.approx(np.mean([0.8, 0.82, 0.79]))
    assert hotpot["StepPO"]["score"].mean == pytest.approx(np.mean([0.4, 0.41, 0.395]))
    assert hotpot["GRPO"]["diagnosis"]["auc"] == pytest.approx((0.6, 0.55, 0.65))
    # StepPO sets lam = 0.9: the diagnosis graded step GAE at its defaults, not this credit.
    assert hotpot["StepPO"]["diagnosis"] == {}
    steppo_paper = "StepPO paper, Qwen3-4B (arXiv 2604.18401)"
    assert hotpot["StepPO"]["published"][steppo_paper] == pytest.approx(0.6378)
    unseen = {r["method"]: r for r in data["columns"][2]["rows"]}
    assert unseen["StepPO"]["published"][steppo_paper] == pytest.approx(0.8582)
    assert not any(r["best"] for r in data["columns"][1]["rows"])  # overlapping intervals
    assert {r["method"]: r["success"].low for r in data["columns"][1]["rows"]}["GRPO"] < 0
    text = table.markdown(data)
    assert "**0.80 ± 0.02" in text and "## alfworld (unseen)" in text
    assert "published: StepPO paper" in text and "0.64" in text
    assert "0.60 [0.55, 0.65]" in text and "0.70 [0.65, 0.75]" not in text
    assert "0.40 ± 0.20 [0.00, 0.90]" in text  # GRPO on ALFWorld: its interval clipped at 0
    paths = table.write_table(str(out))
    rows = open(paths["csv"]).read().splitlines()
    assert len(rows) == 1 + 3 * 2 and "success_low" in rows[0]


def test_table_lists_failed_and_missing_runs(tmp_path):
    out = _sweep_dir(tmp_path, {("hotpotqa", "GRPO"): [0.2, 0.25, 0.22]},
                     failed=("hotpotqa-StepPO-s1",), diagnosis=False)
    data = table.build_table(str(out))
    assert list(data["failed"]) == ["hotpotqa-StepPO-s1"]
    assert "alfworld-GRPO-s0" in data["missing"]
    text = table.markdown(data)
    assert "hotpotqa-StepPO-s1: RuntimeError: boom" in text and "AUC" not in text
    assert "| StepPO | `step_gae` | 0 | - |" in text


def test_claim_output_refuses_another_studys_directory(tmp_path):
    study = _study()
    sweep.claim_output(study, str(tmp_path))
    sweep.claim_output(study, str(tmp_path))  # the same study again: fine
    with pytest.raises(ValueError, match="holds the results of another study"):
        sweep.claim_output(_study(STUDY.replace("iterations = 3", "iterations = 9")),
                           str(tmp_path))


def test_amend_keeps_a_finished_run_tested_on_its_environments_default_split(tmp_path):
    from stepcredit.study.worker import run_config

    out = str(tmp_path / "out")
    study = _study(STUDY.replace('eval_splits = ["seen", "unseen"]\n', ""))
    sweep.claim_output(study, out)
    run = study.run("alfworld-GRPO-s0")
    config = run_config(run, os.path.abspath(out))
    os.makedirs(os.path.join(records.run_dir(out, run.run_id), "checkpoints"))
    records.write_record(out, {"run": run.run_id, "status": records.DONE,
                               "config": config.to_json(), "eval_tasks": run.eval_tasks,
                               "eval": {"seen": {"success": 0.5}}})  # ALFWorld's held-out split
    edited = _study(study.source.replace("tasks = 2", "tasks = 1"))  # the diagnosis only
    assert sweep.claim_output(edited, out, amend=True) == ()
    assert records.read_record(out, run.run_id)["status"] == records.DONE


def test_amend_keeps_the_runs_an_edit_leaves_alone_and_moves_the_others_aside(tmp_path):
    from stepcredit.study.worker import DIAGNOSIS, run_config

    out = str(tmp_path / "out")
    study = _study()
    sweep.claim_output(study, out)

    def left(run_id, status=None):
        config = run_config(study.run(run_id), os.path.abspath(out))
        directory = records.run_dir(out, run_id)
        os.makedirs(os.path.join(directory, "checkpoints"))
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write(config.to_json())
        if status:
            records.write_record(out, {"run": run_id, "status": status, "config": config.to_json(),
                                       "eval_tasks": study.run(run_id).eval_tasks,
                                       "eval": {"test": {"success": 0.5}}})

    left("hotpotqa-GRPO-s0", records.DONE)
    left("hotpotqa-StepPO-s0", records.DONE)
    left("hotpotqa-StepPO-s1")  # interrupted: resumable unless the edit changes it
    left("hotpotqa-GRPO-s1")
    records.write_record(out, {"run": DIAGNOSIS, "status": records.DONE, "kind": "diagnosis"})
    os.makedirs(os.path.join(out, "diagnose"))

    # StepPO's runs change; GRPO's and the diagnosis do not; more iterations for all.
    edited = _study(STUDY.replace("set = { lam = 0.9 }", "set = { lam = 0.8 }")
                    .replace("iterations = 3", "iterations = 4"))
    with pytest.raises(ValueError, match="--amend"):
        sweep.claim_output(edited, out)
    moved = sweep.claim_output(edited, out, amend=True)
    assert moved == ("hotpotqa-GRPO-s0", "hotpotqa-StepPO-s0", "hotpotqa-StepPO-s1")
    aside = os.path.join(out, "superseded", _study().fingerprint())
    assert sorted(os.listdir(os.path.join(aside, "records"))) == ["hotpotqa-GRPO-s0.json",
                                                                  "hotpotqa-StepPO-s0.json"]
    assert sorted(os.listdir(os.path.join(aside, "runs"))) == ["hotpotqa-StepPO-s0",
                                                               "hotpotqa-StepPO-s1"]
    # More iterations: GRPO's finished run loses its record and resumes from its checkpoints,
    # as its interrupted one does.
    for run_id in ("hotpotqa-GRPO-s0", "hotpotqa-GRPO-s1"):
        assert os.path.isdir(os.path.join(records.run_dir(out, run_id), "checkpoints"))
    assert records.read_record(out, "hotpotqa-GRPO-s0") is None
    assert records.read_record(out, DIAGNOSIS)["status"] == records.DONE
    assert os.path.isdir(os.path.join(out, "diagnose"))
    sweep.claim_output(edited, out)  # the directory is now the edited study's
    assert open(os.path.join(out, "study.toml")).read() == edited.source

    # Fewer diagnosis tasks move the diagnosis aside too.
    fewer = _study(edited.source.replace("tasks = 2", "tasks = 1"))
    assert sweep.claim_output(fewer, out, amend=True) == (DIAGNOSIS,)
    assert not os.path.exists(os.path.join(out, "diagnose"))
    assert os.path.isdir(os.path.join(out, "superseded", edited.fingerprint(), "diagnose"))


def test_reuse_copies_only_finished_runs_of_the_same_configuration(tmp_path):
    from stepcredit.study.worker import run_config

    study = _study()
    source, out = str(tmp_path / "source"), str(tmp_path / "out")

    def finished(run_id, status=records.DONE, eval_tasks=None, **change):
        config = dataclasses.replace(run_config(study.run(run_id), os.path.abspath(source)),
                                     **change)
        saved = json.loads(config.to_json())
        del saved["share_contexts"]  # a record written before the option existed
        records.write_record(source, {"run": run_id, "status": status,
                                      "config": json.dumps(saved),
                                      "eval_tasks": eval_tasks or study.run(run_id).eval_tasks,
                                      "eval": {"test": {"success": 0.5}}})
        os.makedirs(os.path.join(records.run_dir(source, run_id), "checkpoints"))
        with open(os.path.join(records.run_dir(source, run_id), "metrics.jsonl"), "w") as f:
            f.write('{"iteration": 0}\n')

    finished("hotpotqa-GRPO-s0")
    finished("hotpotqa-GRPO-s1", learning_rate=0.5)
    finished("hotpotqa-GRPO-s2", status=records.FAILED)
    finished("hotpotqa-StepPO-s0")
    os.makedirs(records.run_dir(out, "hotpotqa-StepPO-s0"))  # interrupted here: resumed
    finished("hotpotqa-StepPO-s1")
    shutil.rmtree(records.run_dir(source, "hotpotqa-StepPO-s1"))  # its record alone
    finished("hotpotqa-StepPO-s2", eval_tasks=3)  # trained the same, tested on fewer tasks

    assert sweep.reuse_runs(study, out, source) == ("hotpotqa-GRPO-s0", "hotpotqa-StepPO-s1")
    copied = records.read_record(out, "hotpotqa-GRPO-s0")
    assert copied["reused_from"] == source and copied["status"] == records.DONE
    assert json.loads(copied["config"])["logdir"] == os.path.abspath(
        records.run_dir(out, "hotpotqa-GRPO-s0"))
    assert sorted(os.listdir(records.run_dir(out, "hotpotqa-GRPO-s0"))) == ["metrics.jsonl"]
    assert os.listdir(records.run_dir(out, "hotpotqa-StepPO-s0")) == []
    assert sorted(os.listdir(os.path.join(out, "records"))) == ["hotpotqa-GRPO-s0.json",
                                                                 "hotpotqa-StepPO-s1.json"]
    assert not os.path.exists(records.run_dir(out, "hotpotqa-StepPO-s1"))
    assert sweep.reuse_runs(study, out, source) == ()


def test_only_selects_jobs_by_pattern_and_leaves_the_others_alone(tmp_path):
    study_path = tmp_path / "study.toml"
    study_path.write_text(STUDY)
    every = sweep.jobs(_study())
    ids = [j.job_id for j in sweep.select_jobs(every, ["hotpotqa-*-s0", "diagnose"])]
    assert ids == ["diagnose", "hotpotqa-GRPO-s0", "hotpotqa-StepPO-s0"]
    assert sweep.select_jobs(every, []) == every
    with pytest.raises(ValueError, match=r"only: 'webshop-\*' matches none of the study's jobs"):
        sweep.sweep(str(study_path), str(tmp_path / "out"), only=["webshop-*"], progress=False)
    assert not os.path.exists(tmp_path / "out")  # refused before anything is written

    out = str(tmp_path / "out")
    for run_id in ("hotpotqa-GRPO-s1", "hotpotqa-StepPO-s1"):
        records.write_record(out, {"run": run_id, "status": records.DONE})
    summary = sweep.sweep(str(study_path), out, only=["hotpotqa-*-s1"], progress=False,
                          note=lambda line: None)
    assert summary == sweep.SweepSummary(skipped=("hotpotqa-GRPO-s1", "hotpotqa-StepPO-s1"),
                                         finished=(), failed=())
    assert sorted(os.listdir(os.path.join(out, "records"))) == ["hotpotqa-GRPO-s1.json",
                                                                 "hotpotqa-StepPO-s1.json"]


def test_records_are_written_whole_with_nan_as_null(tmp_path):
    path = records.write_record(tmp_path, {"run": "a-b-s0", "status": records.DONE,
                                           "eval": {"test": {"success": math.nan}}})
    assert json.load(open(path))["eval"]["test"]["success"] is None
    assert records.read_record(tmp_path, "a-b-s0")["status"] == "done"
    assert records.read_record(tmp_path, "missing-b-s0") is None
    assert os.listdir(tmp_path / "records") == ["a-b-s0.json"]  # no temporary left
    (tmp_path / "records" / "bad-b-s0.json").write_text("{")
    with pytest.raises(ValueError, match="bad-b-s0.json: not a result record"):
        records.load_records(tmp_path)


def test_workers_and_their_threads():
    assert sweep.worker_plan(10, cores=2) == (2, 1)
    assert sweep.worker_plan(0, cores=8) == (1, 8)
    # Fewer jobs left than workers asked for: their cores go to the jobs that run.
    assert sweep.worker_plan(1, workers=2, cores=2) == (1, 2)
    assert sweep.worker_plan(3, workers=2, cores=8) == (2, 4)
    assert sweep.worker_plan(3, workers=2, threads=1, cores=8) == (2, 1)
    assert sweep.worker_plan(5, workers=4, cores=2) == (4, 1)  # oversubscribed, as asked
    with pytest.raises(ValueError, match="--workers 0"):
        sweep.worker_plan(3, workers=0, cores=2)
    with pytest.raises(ValueError, match="--threads 0"):
        sweep.worker_plan(3, threads=0, cores=2)
    env = sweep.worker_environment(1)
    assert env["XLA_FLAGS"].split()[-1] == "--xla_cpu_multi_thread_eigen=false"
    assert env["OMP_NUM_THREADS"] == "1"
    assert all(f.startswith("--") for f in sweep.worker_environment(2)["XLA_FLAGS"].split())
    assert sweep.worker_cores(2, 1, cores=[4, 5]) == [(4,), (5,)]
    assert sweep.worker_cores(2, 2, cores=[0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert sweep.worker_cores(3, 1, cores=[0, 1]) == [(0,), (1,), (0,)]  # oversubscribed


def test_smoothed_is_a_trailing_mean():
    values = np.array([1.0, 0.0, 3.0, 2.0, 5.0])
    expected = [np.mean(values[max(0, t - 2):t + 1]) for t in range(5)]
    np.testing.assert_allclose(curves.smoothed(values, 3), expected)
    with pytest.raises(ValueError, match="window"):
        curves.smoothed(values, 0)


def test_curves_band_over_seeds(tmp_path):
    out = _sweep_dir(tmp_path, {}, diagnosis=False)
    for seed, offset in enumerate((0.0, 0.2, 0.4)):
        logdir = records.run_dir(out, f"hotpotqa-GRPO-s{seed}")
        os.makedirs(logdir)
        with open(os.path.join(logdir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"iteration": -1, "eval/success": 0.0}) + "\n")
            for it in range(4 + seed):
                f.write(json.dumps({"iteration": it, "rollout/success": offset + 0.1 * it}) + "\n")
        if seed < 2:  # seed 2 is still going: left out
            records.write_record(out, {"run": f"hotpotqa-GRPO-s{seed}", "status": records.DONE})
    data = curves.curves(str(out), window=1)
    assert list(data) == ["hotpotqa"] and list(data["hotpotqa"]) == ["GRPO"]
    np.testing.assert_allclose(data["hotpotqa"]["GRPO"],
                               [[o + 0.1 * it for it in range(4)] for o in (0.0, 0.2)])
    path = curves.plot_curves(str(out))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_curve_styles_tell_twenty_one_methods_apart():
    methods = [f"method{i}" for i in range(21)]
    styles = curves.line_styles(methods)
    pairs = {(style["color"], style["linestyle"]) for style in styles.values()}
    assert len(pairs) == 21
    # The eleventh method reuses the first's colour, told apart by its dashes.
    assert styles["method10"]["color"] == styles["method0"]["color"]
    assert styles["method10"]["linestyle"] != styles["method0"]["linestyle"]
