"""Environment steps per second of whole training iterations, before and after the levers.

    python -m benchmarks.iteration_speed [--envs hotpotqa webshop] [--iterations 20]
        [--warmup 5] [--out benchmarks/ITERATION_SPEED.md]

For each environment the README's training command (choice actions, d_model 64,
8 tasks x 8 rollouts, KL 0.1 to the warm-started policy, its warm start; WebShop
with history window 0 and 75 warm-start steps on 512 tasks) is built once per
setting, each adding one lever to the one before (`SETTINGS`): "before" runs
the model as it ran when the levers were not there (`_Before` below: the last
block at every column, the pointer at all 128 label slots, one softmax over
every column, every step row and prompt on its own); then the last block at the
action and label columns only (`TransformerPolicy.hidden_at`), the label slots
bounded by the batch's rows (`label_slots`), the sharing of contexts
(`stepcredit.models.sharing`), the blocked causal attention, and "after", the
default, which also rounds step rows up to 64 columns rather than 32
(`ROW_WIDTH_QUANTUM`: fewer shapes to compile). Each setting runs in a worker
process of its own, warm-started by the default path with the same seed (so all start from the same
state and keys), and their iterations alternate, so whatever else loads the
machine falls on all alike. A whole iteration is rollout, scoring, credit and
update; environment steps are its step rows. Reported per setting: steps per
second over all iterations (compilation included) and after the first `--warmup`, the
median seconds of each phase, the mean training success and the greedy test
success on 64 tasks after the last iteration (the learning is the same up to
float rounding, so these should agree within noise); then each setting's rate
over the one before and after over before.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.sections import write_section
from stepcredit.models import transformer
from stepcredit.train import rows as step_rows
from stepcredit.train.build import make_env, with_fitted_prompt_budget
from stepcredit.train.train_command import add_arguments, config_from_args
from stepcredit.train.trainer import Trainer
from stepcredit.train.warm_start import supervised_warm_start

COMMON = ("--estimator grpo --tasks-per-iteration 8 --group-size 8 --kl-coef 0.1 "
          "--eval-tasks 64 --action-format choice --d-model 64 --max-steps 5 "
          "--learning-rate 1e-3").split()
COMMANDS = {"hotpotqa": ["--env", "hotpotqa", "--warm-start-steps", "36"],
            "webshop": ["--env", "webshop", "--history-window", "0", "--warm-start-steps", "75",
                        "--warm-start-tasks", "512"]}
PHASES = (("rollout s", "time/rollout"), ("scoring s", "time/score"),
          ("update s", "time/update"), ("iteration s", "time/iteration"))


class _DenseAttention(transformer._Attention):
    """The attention before the blocked one: one softmax over every key column, heads
    second in the matmuls."""

    def attend(self, q, k, v, attn_mask, *, causal: bool):
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = jnp.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
        scores = jnp.where(attn_mask[:, None], scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(scores, axis=-1), v)
        return out.transpose(0, 2, 1, 3)


class _FullWidth(transformer.TransformerPolicy):
    """`hidden_at` before the pruned last block: every block at every column, then a
    gather (the pointer's label columns included)."""

    def hidden_at(self, tokens, mask, columns):
        hidden, values = self.hidden(tokens, mask)
        return (jnp.take_along_axis(hidden, columns[..., None], axis=1),
                jnp.take_along_axis(values, columns, axis=1))


class _AllSlots(transformer.TransformerPolicy):
    """The pointer before `label_slots`: the last block at all `MAX_CHOICES` label columns."""

    def choice_logits(self, tokens, mask, columns, marker_ids, slots=None):
        return super().choice_logits(tokens, mask, columns, marker_ids, None)


class _Before(_FullWidth, _AllSlots):
    """Both of the above."""


# Each setting adds one lever: (name, the policy's class, dense attention, share contexts,
# the step rows' width quantum).
SETTINGS = (("before", _Before, True, False, 32),
            ("pruned last block", _AllSlots, True, False, 32),
            ("label slots", transformer.TransformerPolicy, True, False, 32),
            ("shared contexts", transformer.TransformerPolicy, True, True, 32),
            ("blocked attention", transformer.TransformerPolicy, False, True, 32),
            ("after", transformer.TransformerPolicy, False, True, step_rows.ROW_WIDTH_QUANTUM))


def _with_model(trainer: Trainer, policy_class: type, dense_attention: bool) -> None:
    """Points every part of `trainer` at a graph of `policy_class` (with `_DenseAttention`
    in its blocks if asked); the parameters are the same, and a graph of its own compiles
    programs of its own."""
    model = nnx.merge(trainer.parts.graphdef, trainer.state.policy)
    model.__class__ = policy_class
    if dense_attention:
        for block in model.blocks:
            block.attn.__class__ = _DenseAttention
    graphdef, _ = nnx.split(model)
    trainer.parts = trainer.collector.parts = trainer.learner.parts = trainer.parts._replace(
        graphdef=graphdef)


def _trainer(env: str, setting: str, iterations: int, logdir: str) -> Trainer:
    """The README's command for `env`, warm-started, then run as `setting` runs it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(COMMANDS[env] + COMMON + ["--iterations", str(iterations),
                                                       "--logdir", logdir])
    config = with_fitted_prompt_budget(config_from_args(args))
    _, policy_class, dense_attention, share, quantum = next(s for s in SETTINGS if s[0] == setting)
    trainer = Trainer(dataclasses.replace(config, share_contexts=share), log=lambda _: None)
    # Every setting warm-starts by the default path, so all start from the same state.
    trainer.state, _ = supervised_warm_start(trainer.state, trainer.parts,
                                             lambda: make_env(trainer.config, "train"))
    _with_model(trainer, policy_class, dense_attention)
    step_rows.ROW_WIDTH_QUANTUM = quantum  # this setting's process alone
    return trainer


def _serve(env: str, setting: str, iterations: int, connection) -> None:
    """A worker process holding one setting's trainer: runs the iteration it is sent,
    "evaluate", or stops at None. One process per setting, because XLA:CPU maps every
    compiled kernel into the process, and five settings' programs exceed Linux's default
    65,530 mappings in one process."""
    with tempfile.TemporaryDirectory() as logdir:
        trainer = _trainer(env, setting, iterations, logdir)
        connection.send("ready")
        while (command := connection.recv()) is not None:
            connection.send(trainer.evaluate()["success"] if command == "evaluate"
                            else trainer.iteration(command))


def _summary(history: list[dict], warmup: int) -> dict[str, float]:
    late = history[warmup:]
    steps = lambda part: sum(m["batch/rows"] for m in part)  # noqa: E731
    seconds = lambda part: sum(m["time/iteration"] for m in part)  # noqa: E731
    out = {"all": steps(history) / seconds(history), "late": steps(late) / seconds(late),
           "success": float(np.mean([m["rollout/success"] for m in history]))}
    out.update({name: statistics.median(m[key] for m in late) for name, key in PHASES})
    return out


def _ask(connections: dict, command) -> dict:
    """Each worker's answer to `command`, one worker at a time (the others wait idle)."""
    answers = {}
    for name, connection in connections.items():
        connection.send(command)
        answers[name] = connection.recv()
    return answers


def measure(env: str, iterations: int, warmup: int) -> list[str]:
    context = multiprocessing.get_context("spawn")
    connections, workers = {}, []
    for name, *_ in SETTINGS:
        ours, theirs = context.Pipe()
        workers.append(context.Process(target=_serve, args=(env, name, iterations, theirs)))
        workers[-1].start()
        connections[name] = ours
    for connection in connections.values():
        assert connection.recv() == "ready"
    history = {name: [] for name in connections}
    for iteration in range(iterations):
        for name, metrics in _ask(connections, iteration).items():
            history[name].append(metrics)
    tests = _ask(connections, "evaluate")
    for connection in connections.values():
        connection.send(None)
    for worker in workers:
        worker.join()
    summary = {name: _summary(h, warmup) for name, h in history.items()}
    lines = []
    for name, s in summary.items():
        phases = " | ".join(f"{s[title]:.2f}" for title, _ in PHASES)
        lines.append(f"| {env} | {name} | {phases} | {s['all']:,.0f} | {s['late']:,.0f} "
                     f"| {s['success']:.3f} | {tests[name]:.2f} |")
    names = [name for name, *_ in SETTINGS]
    for late, early in [*zip(names[1:], names[:-1]), ("after", "before")]:
        ratios = " | ".join(f"{summary[late][key] / summary[early][key]:.2f}x"
                            for key in ("all", "late"))
        lines.append(f"| {env} | {late} / {early} | | | | | {ratios} | | |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5,
                        help="iterations left out of the 'after warm-up' rate (compilation)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "ITERATION_SPEED.md"))
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.iterations:
        raise ValueError(f"--warmup {args.warmup} must lie in [0, --iterations {args.iterations})")
    header = ("| env | setting | " + " | ".join(f"{title} (median)" for title, _ in PHASES)
              + " | env steps/s, all | env steps/s, after warm-up | training success "
              "| test success |")
    for env in args.envs:
        rows = [header, "|---|---|" + "---:|" * (len(PHASES) + 4), *measure(env, args.iterations,
                                                                          args.warmup)]
        print("\n".join(rows), flush=True)
        begin, end = _markers(env)
        section = "\n".join([
            begin, f"## {env}: training iterations before and after the levers", "",
            f"`python -m benchmarks.iteration_speed --envs {env} --iterations {args.iterations} "
            f"--warmup {args.warmup}` on {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
            f"{os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}; "
            f"1-minute load average at the end {os.getloadavg()[0]:.1f}. Medians over the "
            f"iterations after the first {args.warmup}; \"all\" includes them (and their "
            "compilation).", "", *rows, end])
        write_section(args.out, section, begin, end, "Training iteration speed")
        print(f"wrote {env}'s section of {args.out}")


def _markers(env: str) -> tuple[str, str]:
    """The markers of `env`'s section: a run replaces only the sections of the environments
    it measured."""
    return f"<!-- iteration-speed:{env}:begin -->", f"<!-- iteration-speed:{env}:end -->"


if __name__ == "__main__":
    main()
