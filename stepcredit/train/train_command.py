"""`stepcredit train`: train a policy on an embedded environment with any registered estimator."""

from __future__ import annotations

import argparse
import functools

from stepcredit.settings import parse_setting
from stepcredit.train.curriculum import LEARNING_RATE_SCHEDULES

HELP = "train a policy on an environment with a registered credit-assignment estimator"


def _pair(text: str) -> tuple[str, object]:
    try:
        return parse_setting(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", default="alfworld",
                        help="a registered environment; with --policy qwen also a served one, "
                             "http://HOST:PORT[?schema=NAME&tasks=N], or textworld:GLOB")
    parser.add_argument("--difficulty", type=int, default=0, help="simulator difficulty (0: easiest)")
    parser.add_argument("--estimator", default="grpo", help="registered estimator name")
    parser.add_argument("--set", dest="estimator_config", type=_pair, action="append", default=[],
                        metavar="KEY=VALUE",
                        help="estimator hyperparameter, the value as a JSON literal (true, 0.9, "
                             "null) or a bare string (repeatable)")
    parser.add_argument("--iterations", type=int, default=100,
                        help="training iterations (one rollout batch and update each)")
    parser.add_argument("--tasks-per-iteration", type=int, default=8,
                        help="tasks per batch, each played --group-size times")
    parser.add_argument("--group-size", type=int, default=8,
                        help="rollouts per task (GiGPO and verl-agent: 8)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the model, the sampling and the task order")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="episode step limit (default: the environment's own)")
    parser.add_argument("--horizon-schedule", type=_ints, default=(),
                        help="ScalingInter-RL step limits, e.g. 5,10,15")
    parser.add_argument("--horizon-switch-every", type=int, default=50,
                        help="iterations per stage of --horizon-schedule")
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="supervised steps on expert demonstrations before RL")
    parser.add_argument("--warm-start-tasks", type=int, default=64,
                        help="training tasks whose expert demonstrations the warm start uses")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="iterations between evaluations on the fixed test panel (0: none)")
    parser.add_argument("--eval-tasks", type=int, default=32,
                        help="test tasks of the fixed evaluation panel")
    parser.add_argument("--checkpoint-every", type=int, default=10,
                        help="iterations between checkpoints (the last is always saved)")
    parser.add_argument("--logdir", default="runs/default",
                        help="where metrics, TensorBoard events, config.json and checkpoints go")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --logdir from its newest intact checkpoint "
                             "(its settings must match, except the iteration count, time limit, "
                             "evaluation and checkpoint intervals)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a run already in --logdir (without it, or --resume, such "
                             "a directory is refused)")
    parser.add_argument("--async", dest="async_mode", action="store_true",
                        help="asynchronous rollouts with decoupled PPO (AReaL)")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="with --async, the most policy versions a batch may lag")
    parser.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                        help="stop after this much wall time (warm start included), then "
                             "checkpoint (and evaluate, with --eval-every) (default: no limit)")
    parser.add_argument("--tree-count", type=int, default=0, metavar="M",
                        help="rollout trees per task for tree estimators (tree_grpo; 0: "
                             "max(1, group size // 4))")
    parser.add_argument("--tree-branches", type=int, default=0, metavar="N",
                        help="nodes expanded per tree and round (0: so that the leaves per task "
                             "are the group size, M (1 + L N) = G)")
    parser.add_argument("--tree-rounds", type=int, default=1, metavar="L",
                        help="rounds of tree expansion")
    parser.add_argument("--tree-branching", choices=("random", "entropy"), default="random",
                        help="which nodes a tree expands: at random (Tree-GRPO) or the "
                             "highest-entropy steps (ARPO)")
    parser.add_argument("--vine-rollouts", type=int, default=9, metavar="K",
                        help="continuations from every visited state for Monte Carlo values "
                             "(vineppo; 9 in the VinePPO authors' configs)")
    parser.add_argument("--prm-learning-rate", type=float, default=None,
                        help="learning rate of the implicit PRM (estimators istar, rloo+istar, prime; "
                             "default: 1e-4; 1e-6 with --policy qwen)")
    parser.add_argument("--progress-learning-rate", type=float, default=None,
                        help="learning rate of SPA's progress estimator (estimator spa; default: "
                             "1e-4; 3e-6 with --policy qwen)")
    parser.add_argument("--progress-steps", type=int, default=1,
                        help="optimizer steps of SPA's progress estimator per iteration")
    parser.add_argument("--devices", type=int, default=0,
                        help="devices of the data-parallel update (0: all local devices)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="AdamW learning rate of the RL updates and the warm start (default: "
                             "3e-4; 1e-6 with --policy qwen)")
    parser.add_argument("--lr-schedule", choices=LEARNING_RATE_SCHEDULES, default="constant",
                        help="decay of the RL learning rate over --iterations")
    parser.add_argument("--lr-final-fraction", type=float, default=0.1,
                        help="the learning rate of the last iteration, as a fraction of "
                             "--learning-rate")
    parser.add_argument("--lr-warmup", type=int, default=0, metavar="ITERATIONS",
                        help="first RL iterations over which the learning rate rises "
                             "linearly from 0")
    parser.add_argument("--epochs", type=int, default=None,
                        help="passes over each batch (default: 2; 1 with --policy qwen)")
    parser.add_argument("--target-kl", type=float, default=None,
                        help="stop a batch's epochs once a minibatch's approximate KL exceeds "
                             "1.5 x this (default: never)")
    parser.add_argument("--critic-warmup", type=int, default=0, metavar="ITERATIONS",
                        help="first RL iterations that train only the critic (critic estimators)")
    parser.add_argument("--minibatch-rows", type=int, default=None,
                        help="step rows per update, a multiple of the devices (default: 64; 256 "
                             "with --policy qwen)")
    parser.add_argument("--d-model", type=int, default=256,
                        help="residual width (256: about 1.9M parameters)")
    parser.add_argument("--num-layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--clip-high", type=float, default=None,
                        help="PPO upper clip (default: the estimator's recipe, 0.28 for "
                             "dapo+empg (DAPO's clip-higher), else 0.2)")
    parser.add_argument("--step-level-ratio", action="store_true",
                        help="StepPO's length-normalised step importance ratio (GSPO)")
    parser.add_argument("--kl-coef", type=float, default=0.0,
                        help="weight of the KL penalty to a frozen reference policy (0: none)")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus weight")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of the rollouts (0: greedy)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="step prompt budget; default: fitted to the longest expert prompt "
                             "(plus 25%%) so that no admissible list is dropped")
    parser.add_argument("--max-action-tokens", type=int, default=None,
                        help="the most tokens an action may take (default: 12; 512 with "
                             "--policy qwen)")
    parser.add_argument("--history-window", type=int, default=None,
                        help="(observation, action) pairs of earlier steps in each prompt "
                             "(default: 1; 2 with --policy qwen)")
    parser.add_argument("--action-window", type=int, default=0,
                        help="earlier actions shown, without their observations, before the "
                             "history window's pairs")
    parser.add_argument("--action-format", default="text", choices=("text", "tags", "react", "choice"),
                        help="how the policy's output names an action (choice: the number of an "
                             "admissible action)")
    parser.add_argument("--truncation", choices=("bootstrap", "terminal"), default="bootstrap",
                        help="how an episode cut by the step limit ends for the critic: with "
                             "V(s_next) or, terminal, with 0 (a failure)")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="processes training one policy (one per host; see the README)")
    parser.add_argument("--process-id", type=int, default=0, help="this process's index")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="process 0's address, with --num-processes > 1")
    parser.add_argument("--policy", choices=("word", "qwen"), default="word",
                        help="word: stepcredit's word-level transformer (--d-model, --num-layers); "
                             "qwen: a Qwen2 / Qwen3 chat model from --model-dir (the llm extra)")
    parser.add_argument("--model-dir", default=None,
                        help="with --policy qwen, a Hugging Face folder: config.json, *.safetensors, "
                             "tokenizer.json")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="with --policy qwen, train rank-r LoRA adapters on every attention and "
                             "MLP projection instead of every weight (0: full fine-tuning)")
    parser.add_argument("--critic-learning-rate", type=float, default=1e-5,
                        help="with --policy qwen, the AdamW rate of the critic, a copy of the model "
                             "(estimators step_gae, token_gae, turn_ppo, spa)")
    parser.add_argument("--micro-rows", type=int, default=0,
                        help="with --policy qwen, rows per forward and backward pass of an update, "
                             "the gradients accumulated over --minibatch-rows (0: all at once)")
    parser.add_argument("--no-share-contexts", dest="share_contexts", action="store_false",
                        help="run every step row and prompt on its own, instead of once per kind "
                             "of row sharing its context (equal results up to float rounding)")
    parser.add_argument("--lora-alpha", type=float, default=32.0,
                        help="with --lora-rank, the adapters' scale alpha / r")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="with --policy qwen, the dtype of the parameters and activations")
    parser.add_argument("--free-choice", dest="constrain_choice", action="store_false",
                        help="with --action-format choice, let the policy emit any tokens instead "
                             "of sampling only among the choice tokens on offer")


# Flags whose default depends on --policy, and the config field each sets.
_POLICY_DEFAULTED = {"learning_rate": "learning_rate", "prm_learning_rate": "prm_learning_rate",
                     "progress_learning_rate": "progress_learning_rate",
                     "epochs": "epochs",
                     "minibatch_rows": "minibatch_rows", "max_action_tokens": "rollout.max_action_tokens",
                     "history_window": "rollout.history_window"}


def _fill_policy_defaults(args: argparse.Namespace) -> None:
    """Sets each flag of `_POLICY_DEFAULTED` left unset to its policy's default: the
    `TrainConfig` / `RolloutConfig` field's for the word model, `qwen.DEFAULTS` for a chat model."""
    from stepcredit.rollout import RolloutConfig
    from stepcredit.train.config import TrainConfig
    from stepcredit.train.qwen import DEFAULTS

    for flag, field in _POLICY_DEFAULTED.items():
        if getattr(args, flag) is None:
            owner, name = (RolloutConfig, field[len("rollout."):]) if field.startswith("rollout.") else \
                (TrainConfig, field)
            setattr(args, flag, DEFAULTS[field] if args.policy == "qwen" else getattr(owner, name))


def config_from_args(args: argparse.Namespace):
    from stepcredit.rollout import RolloutConfig
    from stepcredit.train.config import TrainConfig
    from stepcredit.train.update import LossConfig

    _fill_policy_defaults(args)

    loss = LossConfig(kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                      step_level_ratio=args.step_level_ratio, clip_high=args.clip_high)
    return TrainConfig(
        env=args.env, difficulty=args.difficulty, estimator=args.estimator,
        estimator_config=tuple(args.estimator_config), iterations=args.iterations,
        tasks_per_iteration=args.tasks_per_iteration, group_size=args.group_size, seed=args.seed,
        max_steps=args.max_steps, horizon_schedule=args.horizon_schedule,
        horizon_switch_every=args.horizon_switch_every, warm_start_steps=args.warm_start_steps,
        warm_start_tasks=args.warm_start_tasks,
        eval_every=args.eval_every, eval_tasks=args.eval_tasks,
        checkpoint_every=args.checkpoint_every, logdir=args.logdir, async_mode=args.async_mode,
        max_staleness=args.max_staleness, time_limit_minutes=args.time_limit,
        num_devices=args.devices, vine_rollouts=args.vine_rollouts,
        tree_count=args.tree_count, tree_branches=args.tree_branches,
        tree_rounds=args.tree_rounds, tree_branching=args.tree_branching,
        learning_rate=args.learning_rate, prm_learning_rate=args.prm_learning_rate,
        progress_learning_rate=args.progress_learning_rate,
        progress_steps=args.progress_steps,
        learning_rate_schedule=args.lr_schedule,
        final_learning_rate_fraction=args.lr_final_fraction,
        learning_rate_warmup_iterations=args.lr_warmup, epochs=args.epochs,
        target_kl=args.target_kl,
        critic_warmup_iterations=args.critic_warmup,
        minibatch_rows=args.minibatch_rows, d_model=args.d_model, num_layers=args.num_layers,
        policy=args.policy, model_dir=args.model_dir, param_dtype=args.param_dtype,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, micro_rows=args.micro_rows,
        critic_learning_rate=args.critic_learning_rate, share_contexts=args.share_contexts,
        loss=loss, rollout=RolloutConfig(temperature=args.temperature,
                                         **({} if args.max_prompt_tokens is None else
                                            {"max_prompt_tokens": args.max_prompt_tokens}),
                                         max_action_tokens=args.max_action_tokens,
                                         history_window=args.history_window,
                                         action_window=args.action_window,
                                         action_format=args.action_format,
                                         constrain_choice=args.constrain_choice,
                                         bootstrap_truncated=args.truncation == "bootstrap"))


def run(args: argparse.Namespace) -> int:
    from stepcredit import advantages
    from stepcredit.envs import specs as env_specs
    from stepcredit.train.build import with_fitted_prompt_budget
    from stepcredit.train.trainer import Trainer

    if args.num_processes > 1:
        from stepcredit.train.devices import initialize_processes

        if not args.coordinator:
            raise ValueError("--num-processes > 1 needs --coordinator HOST:PORT "
                             "(process 0's address)")
        initialize_processes(args.coordinator, args.num_processes, args.process_id)
    config = config_from_args(args)
    advantages.get(config.estimator).resolve(dict(config.estimator_config))  # before any work
    if config.policy == "word" and env_specs.kind(config.env) != "registered":
        raise ValueError(f"--env {config.env!r}: the word-level policy trains on a registered "
                         "environment (its vocabulary is built from the simulator's); served and "
                         "TextWorld environments need --policy qwen")
    if config.policy == "qwen":
        from stepcredit.train.qwen import QwenTrainer

        if args.num_processes > 1:
            raise ValueError("--policy qwen trains in one process; drop --num-processes")
        trainer = QwenTrainer(config, log=functools.partial(print, flush=True))
    else:
        if args.max_prompt_tokens is None:
            config = with_fitted_prompt_budget(config)
            if args.process_id == 0:
                print(f"prompt budget: {config.rollout.max_prompt_tokens} tokens (fitted to "
                      f"{config.env}'s expert prompts)", flush=True)
        trainer = Trainer(config, log=functools.partial(print, flush=True))
    history = trainer.run(resume=args.resume, overwrite=args.overwrite)
    if history and args.process_id == 0:
        last = history[-1]
        print(f"done: {len(history)} iterations; last batch success {last['rollout/success']:.2f}"
              + (f", eval success {last['eval/success']:.2f}" if "eval/success" in last else "")
              + f"; logs and checkpoints in {config.logdir}")
    return 0
