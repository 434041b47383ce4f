"""A critic for a chat-model policy: a copy of the model with a linear value head.

As in verl's PPO for language models (arXiv 2409.19256), the critic is a
second copy of the policy's transformer, initialised from the same weights,
whose final (normed) hidden state h_n goes through a value head
v(h) = w . h + b instead of the vocabulary projection. The head starts at
w = 0, b = 0, so every value is 0 until the critic learns.

Values are aligned with the log-probs of `stepcredit.llm.learn`: position n of
a `[R, L]` row holds V_n = v(h_{n-1}), the value of the state the model was in
when it drew token n (0 at position 0). In a step row `prompt_ids + action_ids`
the value at the first action token is therefore V(s_t), the value of the step's
prompt (StepPO's step critic); the values at the later action tokens are the
token-level critic of token GAE.

The parameters are a plain pytree {"trunk": the transformer's `nnx.Param`
state, "head": {"w": [d], "b": []}}, trained by its own optimizer. SPA's
progress estimator has the same form (`head_outputs` at a step's last token).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from stepcredit.llm import checkpoint as checkpoints


def init_head(hidden_size: int) -> dict[str, jax.Array]:
    """The value head's parameters, zero: `w` `[d]` and `b` `[]`, float32."""
    return {"w": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def head_outputs(graphdef, trunk, rest, head, rows: dict[str, Any]) -> jax.Array:
    """`[R, L]` float32 w . h_n + b at every position n of `rows` (`tokens`, `mask`): the head on
    the state after token n (SPA's progress estimator reads it at a step's last action token).

    Args:
      graphdef, trunk, rest: the transformer, split as `nnx.split(model, nnx.Param, ...)`,
        `trunk` in the model's dtypes.
      head: the value head (`init_head`).
      rows: `tokens` `[R, L]` int and `mask` `[R, L]` bool (True on real tokens).
    """
    model = nnx.merge(graphdef, trunk, rest)
    positions, attention = checkpoints.attention_inputs(rows["mask"])
    model(rows["tokens"], positions, None, attention, output_hidden_states=True)
    hidden = model.all_hidden_states.get_value()[0].astype(jnp.float32)  # [R, L, d], after the final norm
    return hidden @ head["w"] + head["b"]


def values(graphdef, trunk, rest, head, rows: dict[str, Any]) -> jax.Array:
    """`[R, L]` float32 values V_n = w . h_{n-1} + b of `rows` (0 at n = 0; `head_outputs` shifted
    one position, so V_n values the state the model drew token n in)."""
    return jnp.pad(head_outputs(graphdef, trunk, rest, head, rows)[:, :-1], ((0, 0), (1, 0)))


__all__: Sequence[str] = ("head_outputs", "init_head", "values")
