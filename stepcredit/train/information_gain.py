"""IGPO's beliefs: the policy's log-prob of the ground-truth answer after each step's prompt.

IGPO (arXiv 2510.14967) rewards a turn by the rise it causes in the policy's
probability of the ground-truth answer. Here the belief before step t is the
mean log-prob of the answer's tokens when the policy that sampled the batch is
teacher-forced to answer right after step t's prompt, in the environment's
action syntax (HotpotQA: `finish[answer]`, as `render_action` renders it
under the run's action format): the prompt and the action's tokens before the
answer are the context, and only the answer's tokens are scored, as in the
authors' code, which teacher-forces a fixed `<answer>` prefix and averages the
log-probs of the answer's tokens. Step 0's prompt is the initial prompt, so
b_0 = log P(answer | initial prompt); the belief after the last step is never
needed (the last step is rewarded by the outcome). All (step prompt, answer)
rows of a batch are scored in one batched pass (`Learner.score`).

Environments without a natural answer (WebShop, ALFWorld) give no
`reference_answer()`: their beliefs are 0, so the information gain is 0 and
IGPO trains on its outcome-only form, the discounted group-normalised outcome
(the trainer says so in one warning line at the start). A "winning action"
stand-in (the oracle's last action) was not used: WebShop's is the same
`click[Buy Now]` for every task, and neither is the answer to a question.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from stepcredit import advantages as adv
from stepcredit.batch import StepRecord, Trajectory
from stepcredit.envs.base import Env
from stepcredit.models.tokenizer import Tokenizer
from stepcredit.rollout import Rollout, render_action
from stepcredit.train.rows import StepRowBatch, build_rows

_SLOT = "\x00"  # where the answer goes in the rendered answer action


def answer_prefix(env: Env, tokenizer: Tokenizer, action_format: str) -> list[int] | None:
    """The ids the answer action puts before the answer (`<action>finish[` ...), or None
    when `env` gives no reference answer.

    Raises:
      ValueError: `action_format` is "choice": the policy picks a listed
        action's label, and the answer is not on offer before it is read, so
        its probability cannot be teacher-forced.
    """
    template = getattr(env, "answer_action", None)
    if template is None or not callable(getattr(env, "reference_answer", None)):
        return None
    if action_format == "choice":
        raise ValueError(f"information gain: action_format 'choice' cannot teacher-force the "
                         f"answer of {env.name!r} (it is not among the listed actions before it "
                         f"is read); use a free-text action format")
    rendered = render_action(template.format(_SLOT), None, action_format)
    return tokenizer.encode(rendered.partition(_SLOT)[0])


def gain_mean(beliefs: np.ndarray, mask: np.ndarray, *, gain: str) -> float:
    """The mean information gain (`advantages.information_gain`) over the steps it rewards
    (every step but a trajectory's last); 0 without answers (all beliefs 0) or such steps."""
    mask = np.asarray(mask)
    rewarded = mask & np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1)
    if not (beliefs.any() and rewarded.any()):
        return 0.0
    return float(np.asarray(adv.information_gain(beliefs, mask, gain=gain))[rewarded].mean())


def no_answer_warning(env_name: str, estimator: str) -> str:
    """The line the trainer prints when the environment has no reference answer."""
    return (f"warning: {env_name} gives no reference answer, so {estimator}'s information gain "
            "is 0 and it trains on the discounted group-normalised outcome alone")


def with_answers(rollout: Rollout, envs: Sequence[Env]) -> Rollout:
    """The rollout's trajectories with each one's `answer` from the environment that played it
    (None where the environment gives none)."""
    def answer(env):
        reference = getattr(env, "reference_answer", None)
        return reference() if callable(reference) else None

    return rollout._replace(trajectories=[dataclasses.replace(t, answer=answer(env))
                                          for t, env in zip(rollout.trajectories, envs)])


def answer_rows(trajectories: Sequence[Trajectory], prefix: Sequence[int], tokenizer: Tokenizer,
                *, num_steps: int, multiple: int) -> tuple[StepRowBatch, int]:
    """One row per step of each trajectory with an answer: its prompt, `prefix`, then the
    answer's ids as the scored "action" (`build_rows`); and the longest answer's length."""
    answered = []
    for t in trajectories:
        if t.answer is None:
            answered.append(Trajectory(steps=()))
            continue
        ids = tokenizer.encode(t.answer)
        answered.append(Trajectory(steps=[
            StepRecord(observation_ids=(), action_ids=ids, action_logp=[0.0] * len(ids),
                       reward=0.0, prompt_ids=[*s.prompt_ids, *prefix]) for s in t.steps]))
    longest = max((len(s.prompt_ids) + len(s.action_ids) for t in answered for s in t.steps),
                  default=1)
    rows, _ = build_rows(answered, num_steps=num_steps, row_length=longest,
                         pad_id=tokenizer.special.pad, multiple=multiple)
    width = max((len(s.action_ids) for t in answered for s in t.steps), default=1)
    return rows, width


def answer_logprobs(score: Callable[..., object], params, trajectories: Sequence[Trajectory],
                    prefix: Sequence[int] | None, tokenizer: Tokenizer, *, num_steps: int,
                    multiple: int) -> np.ndarray:
    """`[B, num_steps]` float32 b_t: the mean log-prob of each trajectory's answer after
    step t's prompt under `params` (0 on padding and where there is no answer).

    Args:
      score: `Learner.score(params, rows, width=...)`, returning row log-probs.
      params: the policy that sampled the batch.
      trajectories: the batch (with `answer` where the task has one).
      prefix: `answer_prefix`, or None (no answers: all zeros, nothing scored).
      num_steps, multiple: the batch's step limit and the rows' count multiple.
    """
    out = np.zeros((len(trajectories), num_steps), np.float32)
    if prefix is None or all(t.answer is None for t in trajectories):
        return out
    rows, width = answer_rows(trajectories, prefix, tokenizer, num_steps=num_steps,
                              multiple=multiple)
    # Widths in steps of 4 tokens, so that a few compiled shapes serve all answers.
    width = -(-width // 4) * 4
    logp = np.asarray(score(params, rows, width=width).logprobs)
    counts = rows.action_mask.sum(1)
    means = np.where(rows.action_mask, logp, 0.0).sum(1) / np.maximum(counts, 1)
    valid = rows.valid
    out[rows.trajectory[valid], rows.step[valid]] = means[valid]
    return out
