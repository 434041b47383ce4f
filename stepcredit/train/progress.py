"""SPA's progress estimator: a small transformer whose value head scores each step's progress.

SPA-RL (arXiv 2505.20732) trains a progress estimator E so that the
contributions c_t = E(s_t, a_t) of a trajectory's steps sum to its outcome R
(`stepcredit.advantages.progress_loss`; in the trainer R is the trajectory's
score, the sum of its step rewards, invalid-action penalties included), then rewards each step with
alpha c_t + beta g_t (`stepcredit.advantages.spa`). Here E is a
`TransformerPolicy` with its own parameters (the policy's architecture; it
starts as a copy of the policy, as the authors' estimator starts from their
SFT agent), and c_t is its scalar value head at the last action token of step
t's row (the step's prompt, history included, then its action), the state
after the action. `step_contributions` reads them into the `[B, T]` step
view, `progress_step` takes one optimizer step on the loss (the learner takes
it a chunk of rows at a time, by `weighted_row_gradient`), and
`grounding_signal` reads g_t, whether the environment executed each action,
from the trajectories. The learner (`Learner.update_progress`) and the
diagnosis (`stepcredit.diagnose.progress`) both train E with these.

Notes:
  The paper trains E once, offline, on trajectories the SFT agent explored
  before RL (one epoch, lr 3e-6, the authors' `train_our_progress_model.py`)
  and freezes it; the trainer instead trains it online, `progress_steps`
  full-batch steps on each iteration's trajectories before the credit is
  computed. Its head: a light MLP on the LLM's last hidden state in the
  paper (as a secondary summary reports it; only the abstract was read here),
  a linear map of the language-model logits at the turn's last token in the
  authors' code, and here the transformer's value head (linear) on its final
  hidden state.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stepcredit import advantages as adv
from stepcredit.batch import Trajectory
from stepcredit.train.rows import RowIndex, tokens_from_rows


class ProgressBatch(NamedTuple):
    """What the progress estimator reads and fits: `[R, L]` step rows, their place in the
    `[B, N]` token view, and the `[B, T]` steps and `[B]` outcomes they belong to.

    Attributes:
      tokens, mask, action_mask: `[R, L]` step rows (prompt ids then action ids,
        right-padded), True on real and on action tokens.
      index_b, index_n: `[R, L]` each row token's place in the token view
        (`RowIndex`; 0 off action tokens).
      step_index: `[B, N]` int, the step of each action token, -1 elsewhere.
      step_mask: `[B, T]` bool, True on real steps.
      outcomes: `[B]` float, each trajectory's outcome (its score).
    """

    tokens: jax.Array
    mask: jax.Array
    action_mask: jax.Array
    index_b: jax.Array
    index_n: jax.Array
    step_index: jax.Array
    step_mask: jax.Array
    outcomes: jax.Array


def row_contributions(params, tokens: jax.Array, mask: jax.Array, *,
                      graphdef: nnx.GraphDef) -> jax.Array:
    """`[R]` each step row's contribution: the value head at the row's last real token, its
    action's last (rows are prompt then action, right-padded)."""
    model = nnx.merge(graphdef, params)
    last = jnp.maximum(mask.sum(axis=1) - 1, 0)
    _, values = model.hidden_at(tokens, mask, last[:, None])
    return values[:, 0]


def contributions_from_rows(row_values: jax.Array, batch: ProgressBatch) -> jax.Array:
    """`[B, T]` contributions c_t from the rows' `[R]` values: each is scattered to its
    row's last token in the token view and summed per step, so c_t is 0 on padding steps."""
    last = jnp.maximum(batch.mask.sum(axis=1) - 1, 0)
    at_last = batch.action_mask & (jnp.arange(batch.tokens.shape[1])[None, :] == last[:, None])
    view = tokens_from_rows(jnp.where(at_last, row_values[:, None], 0.0),
                            RowIndex(batch.index_b, batch.index_n), at_last,
                            batch.step_index.shape)
    return adv.step_rewards_from_tokens(view, batch.step_index, batch.step_mask.shape[1])


def step_contributions(params, batch: ProgressBatch, *, graphdef: nnx.GraphDef) -> jax.Array:
    """`[B, T]` contributions c_t: the value head at the last token of each step's row."""
    return contributions_from_rows(
        row_contributions(params, batch.tokens, batch.mask, graphdef=graphdef), batch)


def _loss(params, batch: ProgressBatch, graphdef: nnx.GraphDef) -> jax.Array:
    return adv.progress_loss(step_contributions(params, batch, graphdef=graphdef),
                             batch.step_mask, batch.outcomes)


def _loss_of_rows(row_values: jax.Array, batch: ProgressBatch) -> jax.Array:
    return adv.progress_loss(contributions_from_rows(row_values, batch), batch.step_mask,
                             batch.outcomes)


def weighted_row_gradient(params, tokens: jax.Array, mask: jax.Array, weights: jax.Array, *,
                          graphdef: nnx.GraphDef):
    """The gradient in `params` of sum_r w_r c_r over `[R]` rows (weights `[R]`).

    With w the gradient of the progress loss in the rows' contributions (`row_loss_and_grad`),
    this is the loss's gradient (the chain rule), so the loss, which ties each trajectory's
    steps together, is differentiated a chunk of rows at a time and the chunks' gradients
    summed, without the whole batch's activations at once."""
    return jax.grad(lambda p: jnp.sum(weights * row_contributions(p, tokens, mask,
                                                                  graphdef=graphdef)))(params)


contributions = jax.jit(step_contributions, static_argnames=("graphdef",))
loss_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnames=("graphdef",))
row_values = jax.jit(row_contributions, static_argnames=("graphdef",))
row_loss_and_grad = jax.jit(jax.value_and_grad(_loss_of_rows))
row_gradient = jax.jit(weighted_row_gradient, static_argnames=("graphdef",))
contributions_of_rows = jax.jit(contributions_from_rows)


@functools.partial(jax.jit, static_argnames=("tx",))
def apply_gradient(params, opt_state, grads, *, tx: optax.GradientTransformation):
    """One optimizer update of the estimator: `(params, opt_state)`."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def progress_step(params, opt_state, batch: ProgressBatch, *, graphdef: nnx.GraphDef,
                  tx: optax.GradientTransformation):
    """One optimizer step on SPA's progress loss: `(params, opt_state, loss before the step)`."""
    loss, grads = loss_and_grad(params, batch, graphdef=graphdef)
    params, opt_state = apply_gradient(params, opt_state, grads, tx=tx)
    return params, opt_state, loss


def grounding_signal(trajectories: Sequence[Trajectory], num_steps: int) -> np.ndarray:
    """`[B, T]` bool g_t: True where the environment executed the step's action
    (`info["valid"]`, True when the environment does not say), False on padding."""
    out = np.zeros((len(trajectories), num_steps), bool)
    for b, trajectory in enumerate(trajectories):
        for t, step in enumerate(list(trajectory.steps)[:num_steps]):
            out[b, t] = bool(step.info.get("valid", True))
    return out
