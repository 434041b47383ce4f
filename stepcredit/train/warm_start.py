"""Expert demonstrations as step rows: the supervised warm start before RL.

Every embedded simulator has an expert (`expert_action()`: the oracle's
shortest solution, or on ALFWorld a searching expert that knows only what
the agent has seen); playing it yields (prompt, action) step rows in exactly
the format the policy acts in, so a few supervised steps cure the cold start
of a randomly initialised policy. The same demonstrations size the prompt
budget (`fit_prompt_budget`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.models.tokenizer import Tokenizer
from stepcredit.models.transformer import pack_rows
from stepcredit.rollout import RolloutConfig, action_ids, history_action, step_prompt
from stepcredit.train import update
from stepcredit.train.rows import StepRowBatch, length_groups
from stepcredit.train.state import TrainState

if TYPE_CHECKING:  # build imports this module's budget fitting; the type is for readers only
    from stepcredit.train.build import Parts


def _demonstrations(make_env: Callable, tokenizer: Tokenizer, config: RolloutConfig, *,
                    num_tasks: int, seed: int) -> Iterator[tuple[list[int], list[int]]]:
    """(prompt ids, action ids + `<eoa>`) of every expert step on seeded training tasks."""
    env = make_env()
    tasks = np.random.default_rng([seed, 5]).choice(env.num_tasks, min(num_tasks, env.num_tasks),
                                                    replace=False)
    try:
        for task in tasks.tolist():
            observation, history = env.reset(task), []
            while True:
                action = env.expert_action()
                prompt = step_prompt(tokenizer, config, observation, history)
                ids = action_ids(tokenizer, action, observation.admissible_actions,
                                 config.action_format) + [tokenizer.special.eoa]
                yield prompt.ids, ids
                history.append((observation.text, history_action(config, action, ids)))
                result = env.step(action)
                observation = result.observation
                if result.done or result.truncated:
                    break
    finally:
        env.close()


def demonstration_rows(make_env: Callable, tokenizer: Tokenizer, config: RolloutConfig, *,
                       num_tasks: int, seed: int, row_length: int, multiple: int) -> StepRowBatch:
    """Plays the expert on `num_tasks` training tasks and packs every step as a row.

    Args:
      make_env: builds a training-split environment with `expert_action()`.
      tokenizer: the policy's tokenizer.
      config: the rollout's prompt settings (window, budget, admissible list).
      num_tasks: tasks demonstrated (drawn without replacement, seeded).
      seed: seeds the choice of tasks.
      row_length: L of the rows; multiple: rows are padded to a multiple of it.

    Returns:
      A `StepRowBatch` whose action tokens are the expert's actions plus `<eoa>`
      (the choice token alone under the choice constraint).
    """
    prompts, actions = [], []
    for prompt, action in _demonstrations(make_env, tokenizer, config, num_tasks=num_tasks,
                                          seed=seed):
        prompts.append(prompt)
        actions.append(action[:config.action_length])
    count = -(-len(prompts) // multiple) * multiple
    padding = count - len(prompts)
    packed = pack_rows(prompts + [[tokenizer.special.bos]] * padding, actions + [[]] * padding,
                       length=row_length, pad_id=tokenizer.special.pad)
    valid = np.arange(count) < len(prompts)
    zeros = np.zeros(count, np.int32)
    return StepRowBatch(packed.tokens, packed.mask & valid[:, None], packed.action_mask,
                        np.zeros(packed.tokens.shape, np.float32),
                        np.zeros(packed.tokens.shape, bool), valid, zeros, zeros)


PROMPT_BUDGET_QUANTUM = 32


def fit_prompt_budget(make_env: Callable, tokenizer: Tokenizer, config: RolloutConfig, *,
                      num_tasks: int = 32, seed: int = 0, headroom: float = 1.25) -> int:
    """A prompt budget that fits the environment's step prompts without dropping anything.

    Plays the expert on `num_tasks` training tasks with an unlimited budget,
    takes the longest step prompt (task, history window, observation and the
    admissible list under `config`), adds `headroom` for the longer pages a
    learning agent visits and rounds up to a multiple of 32. A budget below
    the longest prompt would drop history first and then the whole admissible
    list, which leaves a "choice" policy nothing to choose from.

    Returns:
      The budget in tokens.
    """
    unlimited = dataclasses.replace(config, max_prompt_tokens=1 << 20)
    longest = max(len(prompt) for prompt, _ in _demonstrations(
        make_env, tokenizer, unlimited, num_tasks=num_tasks, seed=seed))
    return -(-int(longest * headroom) // PROMPT_BUDGET_QUANTUM) * PROMPT_BUDGET_QUANTUM


def supervised_warm_start(state: TrainState, parts: Parts,
                          make_env: Callable) -> tuple[TrainState, dict[str, float]]:
    """`warm_start_steps` supervised steps on expert demonstrations of training tasks.

    The demonstrations are taken in passes, rows of similar length together.
    Afterwards the RL optimizer starts fresh, and the KL reference and the
    implicit PRM (where present) restart as copies of the warm-started policy.

    Returns:
      The new state and the first and last loss, the number of rows and the time.
    """
    config, tick = parts.config, time.perf_counter()
    rows = demonstration_rows(make_env, parts.tokenizer, config.rollout,
                              num_tasks=min(config.warm_start_tasks, parts.num_train_tasks),
                              seed=config.seed,
                              row_length=config.rollout.max_prompt_tokens
                              + config.rollout.action_length,
                              multiple=config.minibatch_rows)
    rng = np.random.default_rng([config.seed, 11])
    lengths, full = rows.mask.sum(1), rows.tokens.shape[1]
    chunks, losses_seen = [], []
    policy, opt = state.policy, state.opt
    for _ in range(config.warm_start_steps):
        if not chunks:
            chunks = length_groups(lengths, config.minibatch_rows, limit=full, rng=rng)
        chunk, width = chunks.pop()
        policy, opt, loss = update.supervised_step(
            policy, opt, rows.tokens[chunk, :width], rows.mask[chunk, :width],
            rows.action_mask[chunk, :width], graphdef=parts.graphdef, tx=parts.tx,
            choice_markers=config.loss.choice_markers, width=config.loss.action_width)
        losses_seen.append(float(loss))
    state = state.replace(policy=policy, opt=parts.tx.init(policy))
    if state.reference is not None:
        state = state.replace(reference=jax.tree.map(jnp.copy, policy))
    if state.prm is not None:
        prm = jax.tree.map(jnp.copy, policy)
        state = state.replace(prm=prm, prm_opt=parts.prm_tx.init(prm))
    if state.progress is not None:
        progress = jax.tree.map(jnp.copy, policy)
        state = state.replace(progress=progress, progress_opt=parts.progress_tx.init(progress))
    return state, {"warm_start/loss_first": losses_seen[0], "warm_start/loss_last": losses_seen[-1],
                   "warm_start/demonstration_rows": float(rows.valid.sum()),
                   "time/warm_start": time.perf_counter() - tick}
