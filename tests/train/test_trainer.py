"""`stepcredit train` and `stepcredit eval` end to end, on tiny models.

Every run shares one shape family (d_model 32, one layer, 2 tasks x 2 rollouts,
3 steps, 96 + 6 token rows, 16-row minibatches) so the compiled rollout, scoring
and update functions are reused across the module (once per simulator, whose
vocabularies differ); runs go through the CLI in this process, on the 4 fake
devices of the test session.
"""

import dataclasses
import math
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from stepcredit import advantages as adv
from stepcredit.cli import main
from stepcredit.models.transformer import TransformerPolicy, count_params
from stepcredit.prompts import PromptTooLongError
from stepcredit.rollout import RolloutConfig, step_prompt
from stepcredit.train import update as learner
from stepcredit.train.config import TrainConfig
from stepcredit.train.evaluate import evaluate
from stepcredit.train.metrics import read_metrics
from stepcredit.train import rows as step_rows
from stepcredit.train.rows import build_rows, length_groups
from stepcredit.train.build import build_tokenizer, make_env, model_config
from stepcredit.train.trainer import Trainer
from stepcredit.train.warm_start import (demonstration_rows, fit_prompt_budget,
                                         supervised_warm_start)

TINY = ["--iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2", "--max-steps", "3",
        "--d-model", "32", "--num-layers", "1", "--minibatch-rows", "16", "--epochs", "1",
        "--max-prompt-tokens", "96", "--max-action-tokens", "6", "--checkpoint-every", "1"]


# What each iteration logs, whatever the estimator (the value loss only with a critic).
ITERATION_METRICS = ("rollout/success", "rollout/score", "rollout/steps_per_episode",
                     "rollout/invalid_action_rate", "rollout/step_entropy", "advantage/mean",
                     "advantage/std", "advantage/abs_max", "policy/approx_kl",
                     "policy/clip_fraction", "time/rollout", "time/credit", "time/update")


def train(logdir, env: str, estimator: str, *extra: str) -> list[dict]:
    """Runs `stepcredit train` with the tiny settings (later flags override) and reads its metrics."""
    assert main(["train", "--env", env, "--estimator", estimator, "--logdir", str(logdir),
                 *TINY, *extra]) == 0
    return read_metrics(str(logdir))


def restored(logdir) -> Trainer:
    with open(os.path.join(logdir, "config.json"), encoding="utf-8") as f:
        trainer = Trainer(TrainConfig.from_json(f.read()), log=lambda _: None)
    trainer.restore()
    return trainer


def value_head(policy) -> np.ndarray:
    leaves = [np.ravel(x) for path, x in jax.tree_util.tree_leaves_with_path(policy)
              if "value_head" in jax.tree_util.keystr(path)]
    assert leaves, "the policy has no value_head parameters"
    return np.concatenate(leaves)


def assert_finite(rows: list[dict]) -> None:
    for row in rows:
        bad = {k: v for k, v in row.items() if v is None or not math.isfinite(v)}
        assert not bad, f"iteration {row['iteration']}: non-finite metrics {bad}"


@pytest.mark.parametrize("env", ["alfworld", "webshop", "hotpotqa"])
@pytest.mark.parametrize("estimator", adv.names())
def test_every_estimator_trains_and_evaluates_on_every_simulator(tmp_path, capsys, env,
                                                                  estimator):
    rows = train(tmp_path, env, estimator)
    assert [r["iteration"] for r in rows] == [0]
    assert_finite(rows)
    assert rows[0]["batch/rows"] > 0 and "loss/policy" in rows[0]
    assert rows[0]["rollout/steps_per_episode"] > 0
    missing = set(ITERATION_METRICS) - set(rows[0])
    assert not missing, f"metrics not logged: {sorted(missing)}"
    assert any(key.startswith("actions/") for key in rows[0])
    head = value_head(restored(tmp_path).state.policy)
    # The value head starts at zero; only the critic's loss moves it.
    if adv.get(estimator).needs_critic:
        assert "loss/value" in rows[0] and np.abs(head).max() > 0
    else:
        assert "loss/value" not in rows[0]
        np.testing.assert_array_equal(head, 0.0)
    if adv.get(estimator).needs_prm:
        assert math.isfinite(rows[0]["prm/loss"])
    if adv.get(estimator).needs_progress:
        assert math.isfinite(rows[0]["progress/loss"]) and rows[0]["time/progress"] > 0
        state = restored(tmp_path).state  # checkpointed with the run, trained one step
        counts = {int(x) for path, x in jax.tree_util.tree_leaves_with_path(state.progress_opt)
                  if "count" in jax.tree_util.keystr(path)}
        assert state.progress is not None and counts == {1}
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{env} ({estimator}, iteration 1), 2 test tasks" in out
    assert "success" in out and "invalid_action_rate" in out


def test_constrained_choice_format_trains_and_warm_starts(tmp_path):
    rows = train(tmp_path, "alfworld", "step_gae", "--action-format", "choice",
                 "--max-prompt-tokens", "192", "--warm-start-steps", "2",
                 "--warm-start-tasks", "3")
    assert_finite(rows)
    # Sampling only among the choice tokens on offer, even the untrained policy never acts invalidly.
    assert rows[0]["warm_start/loss_last"] > 0 and rows[-1]["rollout/invalid_action_rate"] == 0.0
    trainer = restored(tmp_path)
    assert trainer.config.warm_start_tasks == 3
    # 3 tasks, each demonstrated for at most --max-steps 3 expert steps.
    assert 3 <= rows[0]["warm_start/demonstration_rows"] <= 3 * 3
    special = trainer.tokenizer.special
    assert trainer.config.loss.choice_markers == (special.sep,)


@pytest.mark.parametrize("env", ["alfworld", "webshop", "hotpotqa"])
def test_the_default_policy_is_small_but_not_tiny(env):
    config = model_config(TrainConfig(env=env), build_tokenizer(env).vocab_size)
    assert 1_000_000 <= count_params(TransformerPolicy(config, rngs=nnx.Rngs(0))) <= 5_000_000


def test_evaluation_plays_a_fixed_panel_in_the_loop_and_from_a_checkpoint(tmp_path, capsys):
    rows = train(tmp_path, "alfworld", "grpo", "--eval-every", "1", "--eval-tasks", "3")
    # The policy before RL (iteration -1) and after each iteration, on the same panel.
    assert [r["iteration"] for r in rows] == [-1, 0]
    assert all(0.0 <= r["eval/success"] <= 1.0 and r["eval/steps_per_episode"] > 0 for r in rows)
    trainer = restored(tmp_path)
    again = [evaluate(trainer.graphdef, trainer.state.policy, trainer.tokenizer,
                      trainer.config, num_tasks=3, temperature=t) for t in (0.0, 0.0, 1.0, 1.0)]
    assert again[0] == again[1] and again[2] == again[3]
    assert {k: rows[-1][f"eval/{k}"] for k in again[0]} == again[0]
    # A run evaluated where it lies now, not where config.json says it was trained.
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    shutil.move(str(tmp_path), str(moved))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(moved), "--tasks", "3"]) == 0
    printed = capsys.readouterr().out
    assert "iteration 1)" in printed and f"{again[0]['success']:.3f}" in printed
    assert not tmp_path.exists()


def test_target_kl_stops_the_epochs_early(tmp_path):
    # An entropy bonus moves the policy even where every advantage is 0.
    moving = ("--epochs", "3", "--entropy-coef", "0.01")
    planned = train(tmp_path / "all", "alfworld", "grpo", *moving)[0]
    assert planned["update/minibatches"] == planned["update/minibatches_planned"] == 3
    # The first minibatch starts at the rollout policy (KL 0); any step after it moves away.
    stopped = train(tmp_path / "kl", "alfworld", "grpo", *moving, "--target-kl", "1e-9")[0]
    assert stopped["update/minibatches_planned"] == 3 and stopped["update/minibatches"] < 3
    with pytest.raises(ValueError, match="target_kl=0.0; it must be > 0 or None"):
        TrainConfig(env="alfworld", target_kl=0.0)


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    assert main(["train", "--env", "alfworld", "--estimator", "grpo", "--logdir", str(tmp_path),
                 *TINY, "--resume", "--overwrite"]) == 2
    assert "continue the run or replace it, not both" in capsys.readouterr().err


def test_resume_without_a_checkpoint_says_so_and_starts_over(tmp_path, capsys):
    """A run killed before its first checkpoint, resumed: it starts at iteration 0, and its
    metrics hold each iteration once."""
    killed = tmp_path / "killed"
    train(killed, "alfworld", "grpo", "--eval-every", "1")
    shutil.rmtree(killed / "checkpoints")
    capsys.readouterr()
    resumed = train(killed, "alfworld", "grpo", "--eval-every", "1", "--resume")
    assert f"--resume: {killed} holds no intact checkpoint; the run starts at iteration 0" in (
        capsys.readouterr().out)
    assert [m["iteration"] for m in resumed] == [-1, 0]


def test_eval_command_names_a_missing_checkpoint(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "config.json not found" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(TrainConfig(env="alfworld").to_json())
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert "checkpoints holds no checkpoint" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "0"]) == 2
    assert "--tasks 0: it must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("make, message", [
    (lambda: learner.LossConfig(entropy_coef=float("nan")),
     "LossConfig: entropy_coef=nan; it must be a finite number"),
    (lambda: learner.LossConfig(kl_coef=-1.0), "LossConfig: kl_coef=-1.0; it must be >= 0"),
    (lambda: learner.LossConfig(temperature=0.0), "LossConfig: temperature=0.0; it must be > 0"),
    (lambda: learner.LossConfig(clip_low="0.2"), "LossConfig: clip_low='0.2'; it must be a finite"),
    (lambda: RolloutConfig(temperature=float("inf")),
     "RolloutConfig: temperature=inf; it must be a finite number"),
])
def test_a_loss_or_rollout_setting_that_cannot_train_is_named_before_any_work(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


@pytest.mark.parametrize("field, value, message", [
    ("warm_start_steps", -1, ">= 0"), ("warm_start_tasks", 0, ">= 1"),
    ("horizon_switch_every", 0, ">= 1"), ("learning_rate", -1.0, "> 0"),
    ("eval_tasks", 0, ">= 1"), ("weight_decay", -0.1, ">= 0")])
def test_a_setting_out_of_range_is_named(field, value, message):
    with pytest.raises(ValueError, match=f"TrainConfig: {field}={value}; it must be {message}"):
        TrainConfig(env="alfworld", **{field: value})


def test_the_language_models_settings_are_refused_for_the_word_policy():
    with pytest.raises(ValueError, match="param_dtype='bfloat16' with policy='word'"):
        TrainConfig(env="alfworld", param_dtype="bfloat16")
    with pytest.raises(ValueError, match="lora_alpha=8.0 with policy='word'"):
        TrainConfig(env="alfworld", lora_alpha=8.0)


def test_horizon_curriculum_switches_step_limits(tmp_path):
    rows = train(tmp_path, "alfworld", "grpo", "--iterations", "2", "--horizon-schedule", "2,3",
                 "--horizon-switch-every", "1")
    assert [r["curriculum/step_limit"] for r in rows] == [2.0, 3.0]
    assert rows[0]["rollout/steps_per_episode"] <= 2.0
    assert int(restored(tmp_path).state.stage) == 1


def test_time_limit_stops_after_the_crossing_iteration_and_checkpoints(tmp_path, capsys):
    rows = train(tmp_path, "alfworld", "grpo", "--iterations", "5", "--time-limit", "1e-6",
                 "--checkpoint-every", "10")
    assert [r["iteration"] for r in rows] == [0]
    printed = capsys.readouterr().out
    assert "1/5" in printed and "0.0 min left" in printed and "time limit" in printed
    assert int(restored(tmp_path).state.iteration) == 1


def test_kl_reference_and_step_level_ratio_run(tmp_path):
    rows = train(tmp_path, "alfworld", "grpo", "--kl-coef", "0.05", "--step-level-ratio")
    assert_finite(rows)
    assert "loss/kl" in rows[0]
    trainer = restored(tmp_path)
    assert trainer.config.loss.step_level_ratio and trainer.state.reference is not None


def test_learning_rate_schedule_reaches_the_update(tmp_path):
    # Linear decay to 0 over 2 iterations: iteration 0 learns at the base rate,
    # iteration 1 at rate 0, so (without weight decay) it must leave the policy as it was.
    # Step GAE's critic loss moves the parameters even when every episode fails.
    config = TrainConfig(env="alfworld", estimator="step_gae", iterations=2,
                         tasks_per_iteration=2, group_size=2, max_steps=3, d_model=32,
                         num_layers=1, minibatch_rows=16, epochs=1,
                         rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6),
                         learning_rate=3e-3, learning_rate_schedule="linear",
                         final_learning_rate_fraction=0.0, logdir=str(tmp_path))
    trainer = Trainer(config, log=lambda _: None)
    params = lambda: [np.asarray(x).copy() for x in jax.tree.leaves(trainer.state.policy)]
    initial = params()
    first = trainer.iteration(0)
    after_first = params()
    second = trainer.iteration(1)
    assert (first["optim/learning_rate"], second["optim/learning_rate"]) == (3e-3, 0.0)
    assert any(not np.array_equal(a, b) for a, b in zip(initial, after_first))
    for a, b in zip(after_first, params()):
        np.testing.assert_array_equal(a, b)


def test_learning_rate_warmup_reaches_the_update(tmp_path):
    rows = train(tmp_path, "hotpotqa", "grpo", "--iterations", "3", "--lr-warmup", "2",
                 "--learning-rate", "1e-3")
    np.testing.assert_allclose([r["optim/learning_rate"] for r in rows], [0.0, 5e-4, 1e-3])


def test_critic_warmup_trains_the_critic_without_policy_gradient(tmp_path):
    rows = train(tmp_path, "alfworld", "step_gae", "--iterations", "2", "--critic-warmup", "1",
                 "--epochs", "2")
    assert [r["train/critic_warmup"] for r in rows] == [1.0, 0.0]
    assert rows[0]["loss/policy"] == 0.0 and rows[0]["loss/value"] > 0.0
    assert rows[1]["loss/policy"] != 0.0
    with pytest.raises(ValueError, match="critic_warmup_iterations=1 needs an estimator with a "
                                         "critic; 'grpo' has none"):
        Trainer(TrainConfig(env="alfworld", critic_warmup_iterations=1), log=lambda _: None)


def test_expert_warm_start_lowers_the_supervised_loss(tmp_path):
    config = TrainConfig(env="alfworld", iterations=1, tasks_per_iteration=2, group_size=2,
                         max_steps=3, d_model=32, num_layers=1, minibatch_rows=16, epochs=1,
                         rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6),
                         warm_start_steps=12, warm_start_tasks=8, learning_rate=3e-3,
                         logdir=str(tmp_path))
    trainer = Trainer(config, log=lambda _: None)
    rows = demonstration_rows(lambda: make_env(config, "train"), trainer.tokenizer, config.rollout,
                              num_tasks=8, seed=config.seed,
                              row_length=trainer.learner.row_length, multiple=16)
    loss = jax.jit(lambda state: learner.supervised_loss(state, trainer.graphdef, rows.tokens,
                                                         rows.mask, rows.action_mask))
    before = float(loss(trainer.state.policy))
    trainer.state, metrics = supervised_warm_start(trainer.state, trainer.parts,
                                                   lambda: make_env(config, "train"))
    after = float(loss(trainer.state.policy))
    assert after < 0.8 * before, (before, after)
    assert metrics["warm_start/loss_last"] < metrics["warm_start/loss_first"]
    assert metrics["warm_start/demonstration_rows"] == rows.valid.sum()


def _rolled_out(tmp_path, **fields):
    """A tiny HotpotQA trainer (4-row minibatches, 320-token prompts; `fields` override its
    configuration), the step rows of one rollout of its untrained policy, the rollout's
    trajectories and the rows' index."""
    config = TrainConfig(**{"env": "hotpotqa", "iterations": 1, "tasks_per_iteration": 2,
                            "group_size": 2, "max_steps": 3, "d_model": 32, "num_layers": 1,
                            "minibatch_rows": 4, "epochs": 1, "logdir": str(tmp_path),
                            "rollout": RolloutConfig(max_prompt_tokens=320,
                                                     max_action_tokens=6), **fields})
    trainer = Trainer(config, log=lambda _: None)
    rollout = trainer.collector.rollout(trainer.state.policy, trainer.collector.tasks(0),
                                        jax.random.key(1), 3)
    rows, index = build_rows(rollout.trajectories, num_steps=3,
                             row_length=trainer.learner.row_length,
                             pad_id=trainer.tokenizer.special.pad, multiple=4)
    return trainer, rows, rollout.trajectories, index


def test_scoring_in_length_groups_equals_scoring_full_width_rows(tmp_path, monkeypatch):
    # This task's rows (86 to 121 tokens) fall in one width at the default quantum; any
    # quantum must give the same scores.
    monkeypatch.setattr(step_rows, "ROW_WIDTH_QUANTUM", 32)
    trainer, rows, *_ = _rolled_out(tmp_path)
    widths = {w for _, w in length_groups(rows.mask.sum(1), 4, limit=rows.tokens.shape[1])}
    assert len(widths) > 1, "the rows should differ enough in length to be cut differently"
    grouped = trainer.learner.score(trainer.state.policy, rows)
    full = learner.score(trainer.state.policy, rows.tokens, rows.mask, rows.action_mask,
                         np.float32(1.0), graphdef=trainer.graphdef,
                         choice_markers=trainer.config.loss.choice_markers,
                         width=trainer.config.loss.action_width)
    for name in ("logprobs", "entropies", "values"):
        np.testing.assert_allclose(np.asarray(getattr(grouped, name))[rows.mask],
                                   np.asarray(getattr(full, name))[rows.mask], rtol=1e-5,
                                   atol=1e-5, err_msg=name)


def test_prm_gradient_by_chunks_equals_the_whole_batch_gradient(tmp_path, monkeypatch):
    # iStar's preference loss ties a group's rows together; its gradient is carried into the
    # PRM a chunk of rows at a time, and must equal one pass over the whole batch.
    monkeypatch.setattr(step_rows, "ROW_WIDTH_QUANTUM", 32)
    trainer, rows, *_ = _rolled_out(tmp_path, estimator="rloo+istar")
    assert len(length_groups(rows.mask.sum(1), 4, limit=rows.tokens.shape[1])) > 1
    weights = np.where(rows.action_mask,
                       np.random.default_rng(0).normal(size=rows.action_mask.shape), 0.0
                       ).astype(np.float32)
    chunked = trainer.learner._weighted_gradient(trainer.state.prm, rows, weights)
    loss = trainer.config.loss

    def whole(prm):
        logp = learner.score(prm, rows.tokens, rows.mask, rows.action_mask, np.float32(1.0),
                             graphdef=trainer.graphdef, choice_markers=loss.choice_markers,
                             width=loss.action_width).logprobs
        return jax.numpy.sum(weights * logp)

    expected = jax.grad(whole)(trainer.state.prm)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(expected)) > 1e-3
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(expected)):
        # Summed in another order: equal up to float rounding at the leaf's own scale.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                   atol=1e-4 * float(np.abs(want).max()))


def test_progress_gradient_by_chunks_equals_the_whole_batch_gradient(tmp_path, monkeypatch):
    # SPA's progress loss ties each trajectory's steps together; its gradient is carried
    # into the estimator a chunk of rows at a time, and must equal one pass over the batch.
    from stepcredit.batch import collate
    from stepcredit.train import progress

    monkeypatch.setattr(step_rows, "ROW_WIDTH_QUANTUM", 32)
    trainer, rows, trajectories, index = _rolled_out(tmp_path, estimator="spa")
    assert len(length_groups(rows.mask.sum(1), 4, limit=rows.tokens.shape[1])) > 1
    steps, tokens, _ = collate(trajectories, max_steps=3,
                               max_tokens=3 * trainer.config.rollout.action_length,
                               with_observations=False)
    batch = progress.ProgressBatch(
        tokens=rows.tokens, mask=rows.mask, action_mask=rows.action_mask, index_b=index.b,
        index_n=index.n, step_index=tokens.step_index, step_mask=steps.mask,
        outcomes=np.asarray(steps.score, np.float32) + 1.0)  # a loss that moves every weight
    # A non-zero value head (it starts at zero), so that the body's weights have gradients.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (jax.random.normal(jax.random.key(1), x.shape) * 0.5
                         if "value_head" in jax.tree_util.keystr(path) else x),
        trainer.state.progress)
    whole_loss, expected = progress.loss_and_grad(params, batch, graphdef=trainer.graphdef)
    values = trainer.learner._row_contributions(params, rows)
    loss, upstream = progress.row_loss_and_grad(values, batch)
    np.testing.assert_allclose(float(loss), float(whole_loss), rtol=1e-5)
    chunked = trainer.learner._row_gradient(params, rows, np.asarray(upstream))
    moved = [jax.tree_util.keystr(path) for path, g in jax.tree_util.tree_leaves_with_path(expected)
             if float(np.abs(g).max()) > 1e-4]
    assert any("value_head" in p for p in moved) and any("value_head" not in p for p in moved)
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(expected)):
        # Summed in another order: equal up to float rounding at the leaf's own scale.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                   atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("estimator", ["step_gae", "token_gae"])
def test_steppo_trains_the_critic_only_at_each_step_start(tmp_path, estimator):
    config = TrainConfig(env="hotpotqa", estimator=estimator, iterations=1, tasks_per_iteration=2,
                         group_size=2, max_steps=3, d_model=32, num_layers=1, minibatch_rows=4,
                         epochs=1, rollout=RolloutConfig(max_prompt_tokens=320,
                                                         max_action_tokens=6),
                         logdir=str(tmp_path))
    trainer = Trainer(config, log=lambda _: None)
    rollout = trainer.collector.rollout(trainer.state.policy, trainer.collector.tasks(0),
                                        jax.random.key(1), 3)
    _, prepared = trainer.learner.prepare(trainer.state, rollout.trajectories, 3)
    value_mask, action_mask = (np.asarray(prepared.data.value_mask),
                               np.asarray(prepared.data.action_mask))
    acting = action_mask.any(axis=1)
    assert acting.sum() >= 4 and (action_mask.sum(axis=1) > 1).any()
    if estimator == "token_gae":
        np.testing.assert_array_equal(value_mask, action_mask)
    else:
        first = np.argmax(action_mask, axis=1)
        np.testing.assert_array_equal(value_mask.sum(axis=1), acting.astype(int))
        np.testing.assert_array_equal(value_mask[acting, first[acting]], True)


@pytest.mark.parametrize("env", ["hotpotqa", "webshop"])
def test_fitted_prompt_budget_keeps_every_admissible_list(env):
    rollout = RolloutConfig(action_format="choice")
    config = TrainConfig(env=env, rollout=rollout)
    tokenizer = build_tokenizer(env)
    budget = fit_prompt_budget(lambda: make_env(config, "train"), tokenizer, rollout, num_tasks=8)
    assert budget % 32 == 0 and budget > rollout.max_prompt_tokens
    fitted = dataclasses.replace(rollout, max_prompt_tokens=budget)
    environment = make_env(config, "train")
    default_failures = 0
    for task in range(8, 16):   # tasks the budget was not fitted on
        observation, history = environment.reset(task), []
        for action in environment.oracle_actions():
            prompt = step_prompt(tokenizer, fitted, observation, history)
            assert not prompt.admissible_dropped and prompt.history_dropped == 0
            try:
                default_failures += step_prompt(tokenizer, rollout, observation,
                                                history).admissible_dropped
            except PromptTooLongError:
                default_failures += 1
            history.append((observation.text, action))
            observation = environment.step(action).observation
    # The fixed budget of 160 tokens drops the list these prompts need (or cannot fit at all).
    assert default_failures > 0


def test_device_settings_that_cannot_work_are_named(tmp_path):
    config = TrainConfig(env="alfworld", estimator="empg", minibatch_rows=6, d_model=32,
                         num_layers=1, logdir=str(tmp_path))
    with pytest.raises(ValueError, match="minibatch_rows=6 is not divisible by the 4 devices"):
        Trainer(config)
    with pytest.raises(ValueError, match="num_devices=8 but only 4"):
        Trainer(dataclasses.replace(config, minibatch_rows=16, num_devices=8))


def test_the_saved_config_is_the_one_that_ran(tmp_path):
    rows = train(tmp_path, "alfworld", "dapo+empg", "--set", "zeta=0.1", "--set", "center=false")
    assert "dapo/groups_dropped" in rows[0]
    with open(os.path.join(tmp_path, "config.json"), encoding="utf-8") as f:
        saved = TrainConfig.from_json(f.read())
    # Every value the estimator's entry and recipe imply is written out.
    assert dict(saved.estimator_config) == adv.get("dapo+empg").resolve(
        {"zeta": 0.1, "center": False})
    assert saved.loss.clip_high == 0.28 and saved.dynamic_sampling is True
    assert saved.loss.value_coef == 0.0 and saved.loss.temperature == 1.0
    assert saved.loss.action_width == saved.rollout.action_length
    trainer = restored(tmp_path)
    assert trainer.config == saved  # resolving a resolved configuration changes nothing


def test_one_beta_reaches_both_the_prm_loss_and_its_rewards(tmp_path):
    rows = train(tmp_path, "alfworld", "grpo+istar", "--set", "beta=0.2")
    assert math.isfinite(rows[0]["prm/loss"])
    assert dict(restored(tmp_path).config.estimator_config)["beta"] == 0.2


def test_settings_the_estimator_cannot_take_stop_the_run_before_it_starts(tmp_path, capsys):
    cases = {"a": (["--estimator", "grpo", "--set", "lam=0.9"],
                   "'grpo' has no hyperparameter 'lam'; it takes eps, num_groups, singleton, std"),
             "b": (["--estimator", "grpo+empg", "--set", "center=yes"],
                   "center='yes' is a str; it must be a bool"),
             "c": (["--estimator", "grpo", "--group-size", "1"],
                   "group_size=1, but 'grpo' compares the rollouts")}
    for name, (flags, message) in cases.items():
        assert main(["train", "--env", "alfworld", "--logdir", str(tmp_path / name), *TINY,
                     *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("stepcredit train: ") and message in err and err.count("\n") == 1
    assert not any((tmp_path / name).exists() for name in cases)


def test_an_environment_registered_by_name_trains(tmp_path):
    from stepcredit.envs import registry as env_registry
    from stepcredit.envs.alfworld import AlfWorldEnv

    env_registry.register("household_copy", lambda **kwargs: AlfWorldEnv(**kwargs))
    try:
        rows = train(tmp_path, "household_copy", "grpo")
        assert rows[0]["rollout/steps_per_episode"] > 0
        assert build_tokenizer("household_copy").vocab_size == build_tokenizer("alfworld").vocab_size
    finally:
        env_registry.unregister("household_copy")


def test_an_iteration_sharing_contexts_equals_one_running_every_row(tmp_path):
    """Shared prompts in the rollout and shared rows in scoring, the KL reference and the
    update (`share_contexts`) change nothing but float rounding (both trainers start from
    the seed's parameters and key)."""
    config = TrainConfig(env="hotpotqa", iterations=1, tasks_per_iteration=2, group_size=8,
                         max_steps=3, d_model=32, num_layers=1, minibatch_rows=16, epochs=2,
                         loss=learner.LossConfig(kl_coef=0.1),
                         rollout=RolloutConfig(max_prompt_tokens=320, action_format="choice"),
                         logdir=str(tmp_path))
    shared = Trainer(config, log=lambda _: None)
    alone = Trainer(dataclasses.replace(config, share_contexts=False), log=lambda _: None)
    rollout = shared.collector.rollout(shared.state.policy, shared.collector.tasks(0),
                                       jax.random.key(0), 3)
    rows, _ = build_rows(rollout.trajectories, num_steps=3, row_length=shared.learner.row_length,
                         pad_id=shared.tokenizer.special.pad, multiple=16)
    kinds = shared.learner._shared(rows.tokens, rows.mask, rows.action_mask)
    assert len(kinds.unique) < len(rows.tokens), "a group's first prompts are equal"
    metrics = {"shared": shared.iteration(0), "alone": alone.iteration(0)}
    for name in ("rollout/success", "rollout/steps_per_episode", "batch/rows"):
        assert metrics["shared"][name] == metrics["alone"][name], name
    for name in ("loss/policy", "loss/kl", "policy/entropy", "optim/grad_norm"):
        np.testing.assert_allclose(metrics["shared"][name], metrics["alone"][name], rtol=1e-4,
                                   atol=1e-6, err_msg=name)
    for a, b in zip(jax.tree.leaves(shared.state.policy), jax.tree.leaves(alone.state.policy)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_evaluation_shares_prompts_as_the_run_does(monkeypatch):
    from stepcredit.train import evaluate as evaluate_module

    class Played(Exception):
        pass

    shared = []

    def collect(*args, share_prompts, **kwargs):
        shared.append(share_prompts)
        raise Played

    monkeypatch.setattr(evaluate_module, "collect", collect)
    for share in (True, False):
        with pytest.raises(Played):
            evaluate(None, None, None, TrainConfig(env="alfworld", share_contexts=share),
                     num_tasks=1)
    assert shared == [True, False]
