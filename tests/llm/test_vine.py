"""VinePPO's Monte Carlo values for a chat model: continuations from every visited state."""

import numpy as np
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from stepcredit.envs import registry  # noqa: E402
from stepcredit.llm import checkpoint, rollout, vine  # noqa: E402
from stepcredit.train.vine import MC_VALUE  # noqa: E402
from tests.llm.checkpoints import write  # noqa: E402

SETTINGS = dict(max_new_tokens=6, window=1, invalid_action_penalty=0.1)


def test_a_greedy_continuation_replays_the_episode_so_each_value_is_the_return_to_go(tmp_path):
    write(tmp_path / "model", "qwen2", seed=2)
    qwen = checkpoint.load(tmp_path / "model")

    def make_env():
        return registry.make("hotpotqa", max_steps=3)

    group = rollout.play_group(qwen, make_env, 1, group_size=2, seed=5, temperature=0.0, **SETTINGS)
    valued, metrics = vine.with_mc_values(qwen, make_env, [1], group, rollouts=1, seed=9, temperature=0.0,
                                          **SETTINGS)
    for trajectory in valued:  # greedy: the continuation from s_t is the episode's own rest
        rewards = [step.reward for step in trajectory.steps]
        to_go = np.cumsum(rewards[::-1])[::-1]
        np.testing.assert_allclose([step.info[MC_VALUE] for step in trajectory.steps], to_go, atol=1e-6)
    # greedy group members are the same episode: its states are valued once
    assert metrics["vine/states"] == len(group[0].steps)
    assert metrics["vine/env_steps"] == sum(range(1, len(group[0].steps) + 1))
    broken = [group[0].__class__(steps=(group[0].steps[0].__class__(
        observation_ids=[], action_ids=[], action_logp=[], reward=0.0, anchor=123),))]
    with pytest.raises(ValueError, match="reached another state at step 0 than the one recorded"):
        vine.branch_points(make_env(), [1], broken, None, None)
