"""Construction of a run: environment, tokenizer, model, optimizers and the configuration that runs.

`resolve(config)` turns a `TrainConfig` as given into the one that runs:
every value the trainer would otherwise derive on the fly is written out (the
estimator's full hyperparameters, the critic's weight, the loss's clip-higher
and the dynamic sampling its recipe implies, the sampling temperature the
log-probs refer to, the choice constraint). The trainer saves that, so a
run's `config.json` says what ran. `build(config)` makes the parts.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from stepcredit import advantages as adv
from stepcredit.envs import registry as env_registry
from stepcredit.envs import specs as env_specs
from stepcredit.envs import require_snapshots
from stepcredit.models.tokenizer import WordTokenizer
from stepcredit.models.transformer import TransformerConfig, TransformerPolicy
from stepcredit.rollout import choice_markers
from stepcredit.train import update
from stepcredit.train.config import TrainConfig
from stepcredit.train.state import TrainState
from stepcredit.train.tree import TreeShape

# The critic's weight when an estimator reads critic values and none is given (PPO's 0.5).
DEFAULT_VALUE_COEF = 0.5


def make_env(config: TrainConfig, split: str, max_steps: int | None = None):
    """An environment of `config.env` (a spec of `stepcredit.envs.specs`) on `split`, with the
    run's step limit unless given."""
    return env_specs.make(config.env, split=split, difficulty=config.difficulty, seed=config.seed,
                          max_steps=config.max_steps if max_steps is None else max_steps)


def check_snapshots(config: TrainConfig, purpose: str) -> None:
    """Raises ValueError, in one line naming the environment and `purpose`, unless
    `config.env` can be snapshotted (`stepcredit.envs.require_snapshots`)."""
    env = make_env(config, "train")
    try:
        require_snapshots(env, purpose)
    finally:
        env.close()


def build_tokenizer(env: str) -> WordTokenizer:
    """A word tokenizer covering every text the environment `env` can show.

    Any registered environment works if its instances offer `vocabulary()`
    (the words its tasks, observations and actions contain).
    """
    instance = env_registry.make(env)
    try:
        vocabulary = getattr(instance, "vocabulary", None)
        if vocabulary is None:
            raise ValueError(f"environment {env!r} has no vocabulary(); the word-level policy "
                             "needs the words its texts can contain")
        return WordTokenizer.from_vocabularies(vocabulary())
    finally:
        instance.close()


def model_config(config: TrainConfig, vocab_size: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, d_model=config.d_model,
                             num_layers=config.num_layers, num_heads=config.num_heads,
                             mlp_dim=config.mlp_dim or 4 * config.d_model)


def with_fitted_prompt_budget(config: TrainConfig) -> TrainConfig:
    """`config` with a prompt budget fitted to the environment's expert prompts
    (`warm_start.fit_prompt_budget`), so no admissible list or history is dropped."""
    from stepcredit.train.warm_start import fit_prompt_budget

    budget = fit_prompt_budget(lambda: make_env(config, "train"), build_tokenizer(config.env),
                               config.rollout, seed=config.seed)
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                   max_prompt_tokens=budget))


def resolve(config: TrainConfig, tokenizer: WordTokenizer | None = None) -> TrainConfig:
    """The configuration that runs: `config` with every derived value written out.

    Idempotent: resolving a resolved configuration returns it unchanged.

    Raises:
      ValueError: the estimator or one of its hyperparameters is unknown or
        mistyped, or a setting does not fit the estimator (a critic warm-up
        without a critic; a group estimator with one rollout per task).
    """
    entry = adv.get(config.estimator)
    estimator_config = entry.resolve(dict(config.estimator_config))
    if config.critic_warmup_iterations and not entry.needs_critic:
        raise ValueError(f"TrainConfig: critic_warmup_iterations="
                         f"{config.critic_warmup_iterations} needs an estimator with a critic; "
                         f"{config.estimator!r} has none")
    if entry.needs_groups and config.group_size < 2:
        raise ValueError(f"TrainConfig: group_size={config.group_size}, but {config.estimator!r} "
                         "compares the rollouts of a task: with one per task every advantage "
                         "is 0; use group_size >= 2")
    tokenizer = tokenizer or build_tokenizer(config.env)
    loss = config.loss
    clip_high = loss.clip_high
    if clip_high is None:
        clip_high = entry.recipe.clip_high if entry.recipe.clip_high is not None else loss.clip_low
    loss = dataclasses.replace(
        loss, clip_high=clip_high,
        value_coef=(loss.value_coef or DEFAULT_VALUE_COEF) if entry.needs_critic else 0.0,
        # Scoring must see the distribution that sampled: its temperature and constraint.
        temperature=config.rollout.temperature if config.rollout.temperature > 0 else 1.0,
        decoupled=loss.decoupled or config.async_mode,
        choice_markers=choice_markers(tokenizer, config.rollout),
        action_width=config.rollout.action_length)
    dynamic_sampling = (entry.recipe.dynamic_sampling if config.dynamic_sampling is None
                        else config.dynamic_sampling)
    trees = {}
    if entry.recipe.rollout_trees:  # the forest's derived sizes, written out
        if dynamic_sampling:
            raise ValueError(f"TrainConfig: dynamic sampling refills groups of group_size "
                             f"rollouts; {config.estimator!r} plays trees, which it cannot refill")
        shape = TreeShape.for_group_size(config.group_size, trees=config.tree_count,
                                         branches=config.tree_branches,
                                         rounds=config.tree_rounds,
                                         branching=config.tree_branching)
        trees = {"tree_count": shape.trees, "tree_branches": shape.branches}
    return dataclasses.replace(config, estimator_config=tuple(sorted(estimator_config.items())),
                               loss=loss, dynamic_sampling=dynamic_sampling, **trees)


class Parts(NamedTuple):
    """What a run is made of besides its state.

    Attributes:
      config: the resolved `TrainConfig`.
      estimator: its registry entry.
      tokenizer: the word tokenizer of its environment.
      model_config: the transformer's configuration.
      graphdef: the policy's static graph (`nnx.split`).
      tx: the policy's optimizer.
      prm_tx: the implicit PRM's optimizer, or None.
      progress_tx: SPA's progress estimator's optimizer, or None.
      num_train_tasks: tasks in the training split.
      default_max_steps: the episode step limit when no curriculum stage sets one.
    """

    config: TrainConfig
    estimator: adv.Estimator
    tokenizer: WordTokenizer
    model_config: TransformerConfig
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    prm_tx: optax.GradientTransformation | None
    num_train_tasks: int
    default_max_steps: int
    progress_tx: optax.GradientTransformation | None = None


def prm_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return update.make_optimizer(learning_rate=config.prm_learning_rate, weight_decay=0.0,
                                 grad_clip=10.0)


def progress_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return update.make_optimizer(learning_rate=config.progress_learning_rate, weight_decay=0.0,
                                 grad_clip=10.0)


def build(config: TrainConfig) -> tuple[Parts, TrainState]:
    """The parts of a run and its initial state, from a (resolved or unresolved) config."""
    tokenizer = build_tokenizer(config.env)
    config = resolve(config, tokenizer)
    estimator = adv.get(config.estimator)
    model_cfg = model_config(config, tokenizer.vocab_size)
    graphdef, policy = nnx.split(TransformerPolicy(model_cfg, rngs=nnx.Rngs(config.seed)))
    tx = update.make_optimizer(learning_rate=config.learning_rate,
                               weight_decay=config.weight_decay, grad_clip=config.grad_clip)
    prm_tx = prm_optimizer(config) if estimator.needs_prm else None
    progress_tx = progress_optimizer(config) if estimator.needs_progress else None
    env = make_env(config, "train")
    default_max_steps, num_train_tasks = config.max_steps or env.max_steps, env.num_tasks
    env.close()
    state = TrainState(policy=policy, opt=tx.init(policy), key=jax.random.key(config.seed),
                       iteration=jnp.int32(0), stage=jnp.int32(0))
    if prm_tx is not None:  # iStar: the PRM starts as the policy
        prm = jax.tree.map(jnp.copy, policy)
        state = state.replace(prm=prm, prm_opt=prm_tx.init(prm))
    if progress_tx is not None:  # SPA: the progress estimator starts as the policy
        progress = jax.tree.map(jnp.copy, policy)
        state = state.replace(progress=progress, progress_opt=progress_tx.init(progress))
    if config.loss.kl_coef:
        state = state.replace(reference=jax.tree.map(jnp.copy, policy))
    parts = Parts(config, estimator, tokenizer, model_cfg, graphdef, tx, prm_tx,
                  num_train_tasks, default_max_steps, progress_tx=progress_tx)
    return parts, state
