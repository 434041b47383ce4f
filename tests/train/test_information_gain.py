"""IGPO in the trainer: HotpotQA's reference answer, and the policy's belief in it per step."""

import numpy as np
import pytest

from stepcredit.batch import StepRecord, Trajectory
from stepcredit.envs import registry
from stepcredit.envs.hotpotqa import _BRIDGE, normalize_answer
from stepcredit.models.transformer import pack_rows, score_rows
from stepcredit.rollout import RolloutConfig, step_prompt
from stepcredit.train.build import build_tokenizer
from stepcredit.train.config import TrainConfig
from stepcredit.train.information_gain import (answer_logprobs, answer_prefix,
                                               no_answer_warning)
from stepcredit.train.trainer import Trainer

TINY = dict(estimator="igpo", d_model=32, num_layers=1, minibatch_rows=16, group_size=2,
            tasks_per_iteration=2, max_steps=3,
            rollout=RolloutConfig(max_prompt_tokens=96, max_action_tokens=6))


def test_the_reference_answer_is_never_shown_before_it_is_read():
    env = registry.make("hotpotqa", split="train")
    bridges = 0
    for task in range(40):
        observation = env.reset(task)
        answer = env.reference_answer()
        if env._question.kind in _BRIDGE:  # a comparison question names its candidates
            bridges += 1
            shown = " ".join([observation.text, observation.task, str(observation.anchor),
                              *observation.admissible_actions])
            assert normalize_answer(answer) not in normalize_answer(shown), task
        for action in env.oracle_actions():
            result = env.step(action)
            assert env.reference_answer() == answer  # fixed for the episode, finished included
        assert result.done and result.info["won"] and action == env.answer_action.format(answer)
        assert answer not in map(str, result.info.values())
    assert bridges >= 10
    with pytest.raises(RuntimeError, match="no episode was started"):
        registry.make("hotpotqa").reference_answer()


def test_the_answer_prefix_follows_the_action_format():
    env, other = registry.make("hotpotqa"), registry.make("webshop")
    tokenizer = build_tokenizer("hotpotqa")
    assert answer_prefix(env, tokenizer, "text") == tokenizer.encode("finish[")
    assert answer_prefix(env, tokenizer, "tags") == tokenizer.encode("<action>finish[")
    assert answer_prefix(env, tokenizer, "react") == tokenizer.encode("Action: finish[")
    assert answer_prefix(other, build_tokenizer("webshop"), "text") is None
    with pytest.raises(ValueError, match="action_format 'choice' cannot teacher-force"):
        answer_prefix(env, tokenizer, "choice")


def test_beliefs_score_the_answer_after_each_step_prompt_in_one_batch(tmp_path):
    lines = []
    trainer = Trainer(TrainConfig(env="hotpotqa", logdir=str(tmp_path), **TINY), log=lines.append)
    assert not any("warning" in line for line in lines)
    learner, tokenizer, config = trainer.learner, trainer.tokenizer, trainer.config
    env = registry.make("hotpotqa")
    trajectories = []
    for task in range(3):
        observation, history, steps = env.reset(task), [], []
        for action in env.oracle_actions()[:2]:
            prompt = step_prompt(tokenizer, config.rollout, observation, history).ids
            steps.append(StepRecord((), (7,), (0.0,), 0.0, prompt_ids=prompt))
            history.append((observation.text, action))
            observation = env.step(action).observation
        trajectories.append(Trajectory(steps, group_id=task, answer=env.reference_answer()))
    trajectories.append(Trajectory(trajectories[0].steps, group_id=3))  # no answer: no belief
    beliefs = answer_logprobs(learner.score, trainer.state.policy, trajectories,
                              learner.answer_prefix, tokenizer, num_steps=3, multiple=16)
    assert beliefs.shape == (4, 3) and (beliefs[:3, :2] < 0).all()
    np.testing.assert_array_equal(beliefs[3], 0.0)
    np.testing.assert_array_equal(beliefs[:, 2], 0.0)
    # The same beliefs from a plain forward pass over whole rows, one row per (step, answer).
    prefix = tokenizer.encode("finish[")
    cases = [(b, t, list(s.prompt_ids) + prefix, tokenizer.encode(trajectories[b].answer))
             for b in range(3) for t, s in enumerate(trajectories[b].steps)]
    packed = pack_rows([c[2] for c in cases], [c[3] for c in cases], length=160,
                       pad_id=tokenizer.special.pad)
    logp = np.asarray(score_rows(trainer.graphdef, trainer.state.policy, packed.tokens,
                                 packed.mask, config.loss.temperature).logprobs)
    for (b, t, _, _), row, answer_mask in zip(cases, logp, packed.action_mask):
        np.testing.assert_allclose(beliefs[b, t], row[answer_mask].mean(), rtol=1e-4, atol=1e-5)


def test_an_environment_without_answers_warns_once_at_the_start(tmp_path):
    lines = []
    trainer = Trainer(TrainConfig(env="alfworld", logdir=str(tmp_path), **TINY), log=lines.append)
    assert trainer.learner.answer_prefix is None
    assert lines.count(no_answer_warning("alfworld", "igpo")) == 1
