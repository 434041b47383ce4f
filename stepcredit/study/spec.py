"""A study: environments x methods x seeds, declared in one TOML file.

A study file holds every setting its runs need, so that a sweep is rerun by
naming the file:

    name = "quick"
    seeds = [0, 1]

    [train]                      # TrainConfig fields shared by every run
    iterations = 12
    d_model = 64
    [train.rollout]              # RolloutConfig fields
    action_format = "choice"
    [train.loss]                 # LossConfig fields
    kl_coef = 0.1

    [envs.hotpotqa]              # label -> TrainConfig overrides for that environment
    max_steps = 5
    [envs.alfworld]
    eval_splits = ["seen", "unseen"]

    [methods.StepPO]             # label -> estimator and overrides
    estimator = "step_gae"
    set = { lam = 1.0 }          # estimator hyperparameters
    loss = { step_level_ratio = true }
    published = "steppo"         # its row in stepcredit.study.published

    [diagnose]                   # DiagnoseConfig fields; without it, no diagnosis
    tasks = 8

An environment's table may name its simulator with `env = "..."` (else the
label is the simulator) and the test splits its final policy is evaluated on
with `eval_splits` (else the simulator's held-out split); `eval_tasks` sets
the tasks of that final evaluation. A method's and an environment's tables
take any TrainConfig field; the method's win where both set one. The run
`ENV-METHOD-sSEED` trains `TrainConfig(**train, **env, **method, seed=SEED)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
from typing import Any, Mapping

from stepcredit.rollout import RolloutConfig
from stepcredit.study.published import SOURCES
from stepcredit.train.config import TrainConfig
from stepcredit.train.update import LossConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_LABEL = re.compile(r"^[A-Za-z0-9_.+]+(?:-[A-Za-z0-9_.+]+)*$")
_STUDY_KEYS = ("name", "description", "seeds", "train", "envs", "methods", "diagnose")
_ENV_KEYS = ("env", "eval_splits", "eval_tasks")
_METHOD_KEYS = ("estimator", "set", "published")
# Fields a study does not set: each run's own, or the sweep's.
_RUN_FIELDS = ("env", "estimator", "estimator_config", "seed", "logdir")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a study.

    Attributes:
      run_id: `ENV-METHOD-sSEED`, its directory and record name.
      env: the environment's label; method: the method's label.
      seed: the run's seed.
      config: its TrainConfig (`logdir` is set by the sweep).
      eval_splits: the splits its final policy is evaluated on (empty: the
        simulator's held-out split).
      eval_tasks: tasks of each final evaluation.
      fit_prompt_budget: no table sets `rollout.max_prompt_tokens`, so the run
        fits it to the simulator's expert prompts (as `stepcredit train` does).
    """

    run_id: str
    env: str
    method: str
    seed: int
    config: TrainConfig
    eval_splits: tuple[str, ...]
    eval_tasks: int
    fit_prompt_budget: bool


@dataclasses.dataclass(frozen=True)
class Study:
    """A parsed study file (`load_study`).

    Attributes:
      name, description: shown in tables and progress.
      seeds: every (environment, method) cell runs once per seed.
      train: the TrainConfig shared by every run, before overrides.
      envs: label -> that environment's table, as written.
      methods: label -> that method's table, as written.
      diagnose: DiagnoseConfig fields, or None for no diagnosis.
      source: the study file's text (kept with the sweep's results).
      prompt_budget_set: [train.rollout] sets max_prompt_tokens.
    """

    name: str
    description: str
    seeds: tuple[int, ...]
    train: TrainConfig
    envs: Mapping[str, Mapping[str, Any]]
    methods: Mapping[str, Mapping[str, Any]]
    diagnose: Mapping[str, Any] | None
    source: str
    prompt_budget_set: bool = False

    def runs(self) -> list[Run]:
        """Every run, environment-major, then method, then seed."""
        return [self._run(env, method, seed)
                for env in self.envs for method in self.methods for seed in self.seeds]

    def run(self, run_id: str) -> Run:
        """The run named `run_id`."""
        for run in self.runs():
            if run.run_id == run_id:
                return run
        raise KeyError(f"study {self.name}: no run {run_id!r}")

    def estimator(self, method: str) -> str:
        return self.methods[method]["estimator"]

    def simulator(self, env: str) -> str:
        return self.envs[env].get("env", env)

    def diagnosis(self):
        """The DiagnoseConfig of the study's [diagnose] table (None without one): by default
        its simulators that offer ground truth, and its methods' estimators."""
        from stepcredit.diagnose.config import SIMULATORS

        if self.diagnose is None:
            return None
        simulators = tuple(dict.fromkeys(s for s in map(self.simulator, self.envs)
                                         if s in SIMULATORS))
        estimators = tuple(dict.fromkeys(self.estimator(m) for m in self.methods))
        return diagnose_config(self.diagnose, envs=simulators, estimators=estimators,
                               where=f"study {self.name} [diagnose]")

    def fingerprint(self) -> str:
        """A hash of every run's configuration: two studies with equal runs share it.

        `TrainConfig` fields added after studies were first fingerprinted
        (`FINGERPRINT_NEW_FIELDS`) count only away from their defaults, so a
        result directory written before keeps its identity and resumes.
        """
        diagnosis = self.diagnosis()
        text = json.dumps([(r.run_id, _fingerprinted(r.config), r.eval_splits, r.eval_tasks)
                           for r in self.runs()]
                          + [repr(diagnosis) if diagnosis is not None else None], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _run(self, env: str, method: str, seed: int) -> Run:
        env_table, method_table = self.envs[env], self.methods[method]
        where = f"study {self.name}"
        config = dataclasses.replace(self.train, env=self.simulator(env), seed=seed,
                                     estimator=method_table["estimator"])
        config = _override(config, {k: v for k, v in env_table.items() if k not in _ENV_KEYS},
                           f"{where} [envs.{env}]")
        config = _override(config, {k: v for k, v in method_table.items()
                                    if k not in _METHOD_KEYS}, f"{where} [methods.{method}]")
        estimator_config = dict(config.estimator_config)
        estimator_config.update(method_table.get("set", {}))
        config = dataclasses.replace(config, estimator_config=tuple(sorted(estimator_config.items())))
        budget_set = self.prompt_budget_set or any(
            "max_prompt_tokens" in table.get("rollout", {}) for table in (env_table, method_table))
        # The method's wins, as for every field both tables may set.
        eval_tasks = (config.eval_tasks if "eval_tasks" in method_table
                      else env_table.get("eval_tasks", config.eval_tasks))
        if not isinstance(eval_tasks, int) or isinstance(eval_tasks, bool) or eval_tasks < 1:
            raise ValueError(f"{where} [envs.{env}]: eval_tasks={eval_tasks!r}; it must be an "
                             "int >= 1")
        return Run(run_id=f"{env}-{method}-s{seed}", env=env, method=method, seed=seed,
                   config=config, eval_splits=tuple(env_table.get("eval_splits", ())),
                   eval_tasks=eval_tasks,
                   fit_prompt_budget=not budget_set)


# TrainConfig fields added after the shipped studies were fingerprinted, with their defaults.
FINGERPRINT_NEW_FIELDS = {"policy": "word", "model_dir": None, "param_dtype": "float32", "lora_rank": 0,
                          "lora_alpha": 32.0, "micro_rows": 0, "critic_learning_rate": 1e-5,
                          "share_contexts": True}


def _fingerprinted(config: TrainConfig) -> str:
    fields = dataclasses.asdict(config)
    for name, default in FINGERPRINT_NEW_FIELDS.items():
        if fields.get(name) == default:
            del fields[name]
    return json.dumps(fields, indent=2, sort_keys=True)


def load_study(path: str | os.PathLike) -> Study:
    """Reads and checks a study file; every run's configuration is built here, so a
    mistake (an unknown field, estimator or environment, a bad value) is reported before
    any run starts, naming the file and the table."""
    with open(path, "rb") as f:
        source = f.read()
    try:
        raw = tomllib.loads(source.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"study {path}: not valid TOML: {error}") from None
    return parse_study(raw, source=source.decode("utf-8"), where=str(path))


def parse_study(raw: Mapping[str, Any], *, source: str = "", where: str = "study") -> Study:
    """A Study from a study file's parsed tables (`load_study` reads the file)."""
    from stepcredit import advantages
    from stepcredit.envs import registry as env_registry

    _known(raw, _STUDY_KEYS, where)
    for key in ("name", "description"):
        if not isinstance(raw.get(key, ""), str):
            raise ValueError(f"{where}: {key} must be a string, got {raw[key]!r}")
    tables = [(f"[{key}]", raw[key]) for key in ("train", "envs", "methods", "diagnose")
              if key in raw]
    tables += [(f"[{key}.{label}]", table) for key in ("envs", "methods")
               if isinstance(raw.get(key), dict) for label, table in raw[key].items()]
    for title, table in tables:
        if not isinstance(table, dict):
            raise ValueError(f"{where} {title}: must be a table, got {table!r}")
    name = raw.get("name") or os.path.splitext(os.path.basename(where))[0]
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"{where}: seeds must be a non-empty list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: seeds {seeds} repeat a seed")
    for table in ("envs", "methods"):
        if not raw.get(table):
            raise ValueError(f"{where}: no [{table}.LABEL] table; a study needs at least one")
    train_raw = dict(raw.get("train", {}))
    for field in _RUN_FIELDS:
        if field in train_raw:
            raise ValueError(f"{where} [train]: {field} is set per run (by [envs], [methods], "
                             "seeds or the sweep), not in [train]")
    train = _override(TrainConfig(), train_raw, f"{where} [train]")
    envs: dict[str, dict[str, Any]] = {}
    for label, table in raw["envs"].items():
        _label(label, f"{where} [envs]")
        table = dict(table)
        simulator = table.get("env", label)
        if simulator not in env_registry.names():
            raise ValueError(f"{where} [envs.{label}]: unknown environment {simulator!r}; "
                             f"registered: {', '.join(env_registry.names())}")
        splits = table.get("eval_splits", [])
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise ValueError(f"{where} [envs.{label}]: eval_splits must be a list of split "
                             f"names, got {splits!r}")
        if splits:  # a typo stops the study here, not at the end of a run's training
            probe = env_registry.make(simulator)
            known = getattr(probe, "splits", ("test",))
            probe.close()
            unknown = [s for s in splits if s not in known]
            if unknown:
                raise ValueError(f"{where} [envs.{label}]: unknown eval split {unknown[0]!r}; "
                                 f"{simulator} has {', '.join(known)}")
        envs[label] = table
    methods: dict[str, dict[str, Any]] = {}
    rows = sorted({key for published in SOURCES for key in published.values})  # published
    for label, table in raw["methods"].items():
        _label(label, f"{where} [methods]")
        table = dict(table)
        if "estimator" not in table:
            raise ValueError(f"{where} [methods.{label}]: no estimator")
        try:
            advantages.get(table["estimator"]).resolve(dict(table.get("set", {})))
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{where} [methods.{label}]: {error}") from None
        if "published" in table and table["published"] not in rows:
            raise ValueError(f"{where} [methods.{label}]: published={table['published']!r} is no "
                             f"row of the published numbers; they have {', '.join(rows)}")
        methods[label] = table
    diagnose = raw.get("diagnose")
    study = Study(name=name, description=raw.get("description", ""), seeds=tuple(seeds),
                  train=train, envs=envs, methods=methods, diagnose=diagnose, source=source,
                  prompt_budget_set="max_prompt_tokens" in train_raw.get("rollout", {}))
    ids = [run.run_id for run in study.runs()]  # every override applied and checked now
    twice = sorted({run_id for run_id in ids if ids.count(run_id) > 1})
    if twice:
        raise ValueError(f"{where}: two runs would be named {twice[0]!r} (ENV-METHOD-sSEED); "
                         "rename an environment or a method")
    study.diagnosis()
    return study


def diagnose_config(table: Mapping[str, Any], *, envs: tuple[str, ...] | None = None,
                    estimators: tuple[str, ...] = (), where: str = "[diagnose]"):
    """The DiagnoseConfig of a study's [diagnose] table (lists become tuples)."""
    from stepcredit.diagnose.config import DiagnoseConfig

    fields = {f.name for f in dataclasses.fields(DiagnoseConfig)}
    unknown = sorted(set(table) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; DiagnoseConfig has "
                         f"{', '.join(sorted(fields))}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    if envs is not None and "envs" not in table:
        values["envs"] = envs
    if estimators and "estimators" not in table:
        values["estimators"] = estimators
    try:
        return DiagnoseConfig(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def _label(label: str, where: str) -> None:
    if not _LABEL.match(label):
        raise ValueError(f"{where}: label {label!r} must be letters, digits and _ . + joined "
                         "by single '-' (it names run directories)")


def _known(table: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; expected "
                         f"{', '.join(keys)}")


def _override(config, values: Mapping[str, Any], where: str):
    """`config` with `values` replaced, nested dataclasses (rollout, loss) by their own
    tables; each value checked against its field's default type."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"{where}: unknown field {key!r} of {type(config).__name__}")
        current = getattr(config, key)
        if isinstance(current, (RolloutConfig, LossConfig)):
            if not isinstance(value, Mapping):
                raise ValueError(f"{where}: {key} must be a table of "
                                 f"{type(current).__name__} fields, got {value!r}")
            changes[key] = _override(current, value, f"{where} {key}")
        else:
            changes[key] = _typed(current, value, f"{where} {key}")
    try:
        return dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def _typed(current: Any, value: Any, where: str) -> Any:
    if isinstance(value, list):
        value = tuple(tuple(v.items()) if isinstance(v, dict) else v for v in value)
    if isinstance(value, dict):
        value = tuple(sorted(value.items()))
    expected = type(current)
    if current is None or isinstance(current, tuple) and isinstance(value, tuple):
        return value
    if expected is bool and not isinstance(value, bool) or (
            expected in (int, float) and (isinstance(value, bool)
                                          or not isinstance(value, (int, float)))) or (
            expected is str and not isinstance(value, str)):
        raise ValueError(f"{where}: expected {expected.__name__}, got {value!r}")
    if expected is int and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        value = int(value)
    return expected(value) if expected is float else value
