"""`stepcredit eval`: evaluate a checkpoint on the fixed panel of test tasks."""

from __future__ import annotations

import argparse
import dataclasses
import os

HELP = "evaluate a trained checkpoint on a fixed panel of test tasks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory (the --logdir of `stepcredit train`)")
    parser.add_argument("--tasks", type=int, default=100, help="test tasks 0..N-1")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--split", default=None, help="test split (default: the held-out one)")


def run(args: argparse.Namespace) -> int:
    from stepcredit.train.config import TrainConfig
    from stepcredit.train.evaluate import evaluate
    from stepcredit.train.trainer import Trainer

    if args.tasks < 1:
        raise ValueError(f"--tasks {args.tasks}: it must be >= 1")
    config_path = os.path.join(args.checkpoint, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"--checkpoint: {config_path} not found; it takes the run "
                         f"directory that `stepcredit train --logdir` wrote")
    checkpoints = os.path.join(args.checkpoint, "checkpoints")
    if not os.path.isdir(checkpoints) or not os.listdir(checkpoints):
        raise ValueError(f"--checkpoint: {checkpoints} holds no checkpoint; the run saved none "
                         "(yet), so there is no trained policy to evaluate")
    with open(config_path, encoding="utf-8") as f:
        # The run is read where it lies now, wherever it was trained (config.json keeps that).
        config = dataclasses.replace(TrainConfig.from_json(f.read()), logdir=args.checkpoint)
    trainer = Trainer(config)
    iteration = trainer.restore()
    results = evaluate(trainer.graphdef, trainer.state.policy, trainer.tokenizer, config,
                       num_tasks=args.tasks, temperature=args.temperature, split=args.split)
    print(f"{config.env} ({config.estimator}, iteration {iteration}), {args.tasks} test tasks, "
          f"temperature {args.temperature}:")
    for name, value in results.items():
        print(f"  {name:<36} {value:.3f}")
    return 0
