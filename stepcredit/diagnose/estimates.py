"""Every registered estimator's step credit on the same sampled episodes.

The episodes become the trainer's own `Trajectory` records and are collated
by `stepcredit.batch.collate` (which owns the conventions: done and truncated
on the last step, the score as the sum of rewards, padding), and each
estimator runs through the trainer's call
(`stepcredit.credit.compiled_compute_advantages`, whitening included), so a
diagnosis grades exactly the advantages a stepcredit policy loss would see.
Credit is compared per step: trajectory-level advantages are broadcast over
the trajectory's steps, token-level ones are averaged over each step's action
tokens.

Each step's action has a number of tokens (`TokenView.lengths`): the implicit
PRM's tokenisation when one is fitted (`stepcredit.diagnose.prm`), else one
token per whitespace-separated word. Bootstrap values are 0: after a
truncation no steps remain under the episode's step limit. VinePPO reads the
episodes' `mc_value` (rollouts of the behaviour policy on their own stream,
`stepcredit.diagnose.sample`); without them it is not run. IGPO reads the
episodes' `answer_prob`, as log-probs floored at `ANSWER_LOGP_FLOOR` (the
answer action is often not on offer: probability 0); an episode without one
(ALFWorld, WebShop: no reference answer) has no information gain.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from stepcredit import advantages as adv
from stepcredit.batch import StepRecord, Trajectory, collate
from stepcredit.credit import compiled_compute_advantages
from stepcredit.diagnose.episodes import Episode, Stacked
from stepcredit.keys import stable_key

# Reference rows graded beside the estimators: the truth itself (an upper
# bound) and credit drawn at random (the floor).
REFERENCES = ("mc_advantage", "random")

# log pi(answer) where the answer action is not on offer (probability 0): a finite floor.
ANSWER_LOGP_FLOOR = float(np.log(1e-6))


class TokenView(NamedTuple):
    """The action tokens of each episode's steps.

    Attributes:
      lengths: per episode, `[T]` int, the number of action tokens of each step.
      prm_logp, ref_logp: `[B, N]` implicit-PRM and reference log-probs of the
        action tokens, laid out step after step (None without a PRM).
    """

    lengths: Sequence[np.ndarray]
    prm_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(max(int(np.sum(n)) for n in self.lengths))


def bucket(n: int) -> int:
    """The power of two at or above `n` (at least 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def word_tokens(episodes: Sequence[Episode]) -> TokenView:
    """One action token per whitespace-separated word of each step's action (at least one)."""
    return TokenView([np.array([max(1, len(a.split())) for a in e.actions]) for e in episodes])


def prm_tokens(step_index: np.ndarray, prm_logp: np.ndarray, ref_logp: np.ndarray,
               episodes: Sequence[Episode]) -> TokenView:
    """The token view of a fitted PRM's `[B, N]` step-after-step layout."""
    lengths = [np.bincount(row[row >= 0], minlength=e.length)
               for row, e in zip(step_index, episodes)]
    return TokenView(lengths, prm_logp, ref_logp)


def trajectories(episodes: Sequence[Episode], values: Sequence[np.ndarray], tokens: TokenView,
                 group_ids: np.ndarray) -> list[Trajectory]:
    """The episodes as the trainer's records: each step's reward, value V(s_t),
    entropy (on each of its action tokens), anchor key and done/truncated flag, and
    each episode's rollout tree (one id per (seed, tree); None for a chain)."""
    out, trees = [], {}
    for e, v, lengths, group in zip(episodes, values, tokens.lengths, group_ids):
        steps = [StepRecord(observation_ids=(), action_ids=(0,) * int(n),
                            action_logp=(0.0,) * int(n), reward=float(e.rewards[t]),
                            done=t == e.length - 1 and not e.truncated,
                            truncated=t == e.length - 1 and e.truncated,
                            action_entropy=(float(e.entropy[t]),) * int(n), value=float(v[t]),
                            anchor=stable_key(e.anchors[t]))
                 for t, n in enumerate(lengths)]
        tree = None if e.tree is None else trees.setdefault((e.seed, e.tree), len(trees))
        out.append(Trajectory(steps, group_id=int(group), tree_id=tree))
    return out


def step_credit(names: Sequence[str], episodes: Sequence[Episode], stacked: Stacked,
                values: Sequence[np.ndarray], tokens: TokenView, *, num_steps: int | None = None,
                num_tokens: int | None = None, progress: np.ndarray | None = None,
                grounding: np.ndarray | None = None
                ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Each estimator's `[B, T]` step credit (0 on padding).

    Args:
      names: registered estimator names.
      episodes: the episodes, and `stacked` their `stack`.
      values: per episode, `[T]` V(s_t) for the critic-based estimators.
      tokens: the token view (PRM log-probs for iStar and PRIME).
      num_steps, num_tokens: pad T and N to these (default: the next power of
        two); give the same across simulators to compile once.
      progress, grounding: `[B, T]` SPA's progress contributions and grounding
        signal (`stepcredit.diagnose.progress`), or None.

    Returns:
      `(credit, failures)`: name -> `[B, T]` float64 credit, and name -> the
      error of each estimator that refused these inputs.

    Raises:
      ValueError: `num_steps` or `num_tokens` is below what the episodes need.
    """
    t = stacked.mask.shape[1]
    t_pad, n_pad = num_steps or bucket(t), num_tokens or bucket(tokens.num_tokens)
    if t_pad < t or n_pad < tokens.num_tokens:
        raise ValueError(f"step_credit: num_steps={t_pad}, num_tokens={n_pad} below the "
                         f"episodes' {t} steps and {tokens.num_tokens} tokens")
    steps, token_batch, _ = collate(trajectories(episodes, values, tokens, stacked.group_ids),
                                    max_steps=t_pad, max_tokens=n_pad, with_observations=False)
    token_values = np.asarray(adv.broadcast_to_tokens(steps.value, token_batch.step_index))
    prm = {}
    if tokens.prm_logp is not None:
        pad = ((0, 0), (0, n_pad - tokens.prm_logp.shape[1]))
        prm = {"prm_logp": np.pad(tokens.prm_logp.astype(np.float32), pad),
               "ref_logp": np.pad(tokens.ref_logp.astype(np.float32), pad)}
    mc_values = None
    if all(e.mc_value is not None for e in episodes):
        mc_values = np.zeros((len(episodes), t_pad), np.float32)
        for i, e in enumerate(episodes):
            mc_values[i, :e.length] = e.mc_value
    answer_logp = np.zeros((len(episodes), t_pad), np.float32)
    for i, e in enumerate(episodes):
        if e.answer_prob is not None:
            answer_logp[i, :e.length] = np.maximum(np.log(np.maximum(e.answer_prob, 1e-300)),
                                                   ANSWER_LOGP_FLOOR)
    if progress is not None:  # the other fitted model's inputs, beside the PRM's
        pad = ((0, 0), (0, t_pad - progress.shape[1]))
        prm.update(progress=np.pad(progress.astype(np.float32), pad),
                   grounding=np.pad(np.asarray(grounding, bool), pad))
    counts = np.asarray(adv.step_rewards_from_tokens(
        np.ones(token_batch.step_index.shape, np.float32), token_batch.step_index, t_pad))
    credit, failures = {}, {}
    for name in names:
        try:
            out = compiled_compute_advantages(steps, token_batch, name,
                                              token_values=token_values, mc_values=mc_values,
                                              answer_logp=answer_logp, **prm)
        except ValueError as error:  # e.g. a user's estimator refusing these inputs
            failures[name] = str(error)
            continue
        if out.step_advantages is not None:
            per_step = np.asarray(out.step_advantages, dtype=np.float64)
        else:  # the mean over each step's action tokens
            sums = np.asarray(adv.step_rewards_from_tokens(out.token_advantages,
                                                           token_batch.step_index, t_pad))
            per_step = sums / np.maximum(counts, 1.0)
        credit[name] = np.where(stacked.mask, per_step[:, :t], 0.0)
    return credit, failures


def reference_credit(stacked: Stacked, seed: int) -> dict[str, np.ndarray]:
    """The reference rows: the Monte Carlo A^pi itself (when estimated), and standard normal noise."""
    noise = np.random.default_rng([seed, 7]).standard_normal(stacked.mask.shape)
    out = {"random": np.where(stacked.mask, noise, 0.0)}
    if np.isfinite(stacked.advantage[stacked.mask]).all():
        out = {"mc_advantage": np.where(stacked.mask, stacked.advantage, 0.0), **out}
    return out
