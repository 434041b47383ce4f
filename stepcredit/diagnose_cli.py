"""`stepcredit diagnose`: grade every estimator's step credit against ground truth.

    stepcredit diagnose --env webshop --policy eps=0.3 --estimators all \\
        --tasks 64 --group-size 8 --seeds 3

samples the simulators' episodes once, runs every estimator on the same ones
and writes `diagnose.md`, `diagnose.csv`, `diagnose.json`, `auc.png` and
`examples.png` to `--output`, printing the Markdown tables.

    stepcredit diagnose --input steps.parquet --label-column human_label

grades the estimators on a log of step rows whose rows carry a per-step label
(`stepcredit.diagnose.offline`).
"""

from __future__ import annotations

import argparse

HELP = "grade every estimator's step credit against simulator ground truth or logged labels"


def _names(values: list[str]) -> tuple[str, ...]:
    out = tuple(v for value in values for v in value.split(",") if v)
    return () if out == ("all",) else out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stepcredit.diagnose.config import SIMULATORS, DiagnoseConfig
    from stepcredit.diagnose.values import VALUE_SOURCES

    d = DiagnoseConfig()
    parser.add_argument("--env", action="append", default=[], metavar="ENV",
                        help=f"simulator(s), repeatable or comma-separated (default: "
                             f"{','.join(SIMULATORS)})")
    parser.add_argument("--policy", default=d.policy,
                        help="behaviour policy: eps=EPS (expert, else uniform with probability "
                             "EPS), uniform, deviation (one wrong step at a random step of the "
                             "expert's path), deviation@STEP or checkpoint=LOGDIR (a trained run, "
                             "over the admissible actions)")
    parser.add_argument("--estimators", action="append", default=[], metavar="NAMES",
                        help="estimator names, repeatable or comma-separated; all (the default) "
                             "for every registered one")
    parser.add_argument("--tasks", type=int, default=d.tasks, help="tasks per simulator and seed")
    parser.add_argument("--group-size", type=int, default=d.group_size, help="episodes per task")
    parser.add_argument("--seeds", type=int, default=len(d.seeds),
                        help="number of seeds (0, 1, ...)")
    parser.add_argument("--continuations", type=int, default=d.continuations,
                        help="K: Monte Carlo rollouts per action and per state for A^pi")
    parser.add_argument("--vine-rollouts", type=int, default=d.vine_rollouts,
                        help="K': rollouts per state for VinePPO's Monte Carlo values (their "
                             "own random stream)")
    parser.add_argument("--values", default=d.values, choices=VALUE_SOURCES,
                        help="critic of step and token GAE (checkpoint: --value-checkpoint's "
                             "value head)")
    parser.add_argument("--value-checkpoint", default=None, metavar="LOGDIR",
                        help="the trained run whose value head --values checkpoint reads")
    parser.add_argument("--prm-steps", type=int, default=d.prm_steps,
                        help="optimizer steps of the implicit PRM of iStar and PRIME and of "
                             "SPA's progress estimator")
    parser.add_argument("--bootstrap", type=int, default=d.bootstrap,
                        help="bootstrap resamples per confidence interval")
    parser.add_argument("--split", default=d.split, help="task split")
    parser.add_argument("--difficulty", type=int, default=None,
                        help="simulator difficulty (default: each one's)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="step limit (default: 15 on alfworld, else each simulator's)")
    parser.add_argument("--input", default=None,
                        help="diagnose a log of step rows instead (JSONL/Parquet/save_to_disk)")
    parser.add_argument("--label-column", default=None,
                        help="with --input: the per-step label column (> 0: a good step)")
    parser.add_argument("--success-threshold", type=float, default=1.0,
                        help="with --input: a trajectory whose score reaches this succeeded")
    parser.add_argument("--output", default="runs/diagnose",
                        help="folder for diagnose.md/.csv/.json and the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    from stepcredit.diagnose import report

    estimators = _names(args.estimators)
    if args.input is not None:
        from stepcredit.diagnose.offline import diagnose_log

        if args.label_column is None:
            raise ValueError("--input needs --label-column: the per-step label to grade against")
        diagnosis = diagnose_log(args.input, args.label_column, estimators=estimators,
                                 success_threshold=args.success_threshold,
                                 bootstrap=args.bootstrap, progress=not args.no_progress)
    else:
        if args.label_column is not None:
            raise ValueError("--label-column is read only with --input")
        from stepcredit.diagnose.config import SIMULATORS, DiagnoseConfig
        from stepcredit.diagnose.run import diagnose

        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        config = DiagnoseConfig(
            envs=_names(args.env) or SIMULATORS, policy=args.policy, estimators=estimators,
            tasks=args.tasks, group_size=args.group_size, seeds=tuple(range(args.seeds)),
            continuations=args.continuations, vine_rollouts=args.vine_rollouts,
            values=args.values,
            value_checkpoint=args.value_checkpoint, prm_steps=args.prm_steps,
            bootstrap=args.bootstrap, split=args.split, difficulty=args.difficulty,
            max_steps=args.max_steps)
        diagnosis = diagnose(config, progress=not args.no_progress, log=print)
    paths = report.write_report(diagnosis, args.output)
    print(report.markdown(diagnosis))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
