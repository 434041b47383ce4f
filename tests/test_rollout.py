"""Rollouts keep the exact sampled tokens; action parsers; export in the step-row schema."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from stepcredit.data import load_trajectories, save_trajectories
from stepcredit.envs import registry
from stepcredit.envs.pool import EnvPool
from stepcredit.models.transformer import TransformerConfig, TransformerPolicy, score_rows
from stepcredit.rollout import (ActionParseError, RolloutConfig, action_ids, choice_markers,
                                collect, parse_choice, parse_react, parse_tags, parse_text,
                                render_action)
from stepcredit.train.build import build_tokenizer

ADMISSIBLE = ("go to desk 1", "look", "inventory")


@pytest.mark.parametrize("fmt", ["text", "tags", "react", "choice"])
def test_rendered_actions_parse_back(fmt):
    from stepcredit.rollout import ACTION_PARSERS
    for action in ADMISSIBLE:
        assert ACTION_PARSERS[fmt](render_action(action, ADMISSIBLE, fmt), ADMISSIBLE) == action


def test_choice_actions_are_one_choice_token():
    tokenizer = build_tokenizer("hotpotqa")
    admissible = [f"search[{i}]" for i in range(30)]
    ids = action_ids(tokenizer, "search[20]", admissible, "choice")
    assert ids == [tokenizer.special.choices[20]]
    assert parse_choice(tokenizer.decode(ids), admissible) == "search[20]"
    assert action_ids(tokenizer, "look", ["look"], "text") == tokenizer.encode("look")


def test_parsers_reject_malformed_outputs():
    assert parse_text("  look ") == "look"
    assert parse_tags("<think>hmm</think><action> look </action>") == "look"
    assert parse_react("Thought: x\nAction: go to desk 1\n") == "go to desk 1"
    assert parse_choice("2", ADMISSIBLE) == "look"
    for parse, output in [(parse_tags, "look"), (parse_react, "look"), (parse_choice, "4"),
                          (parse_choice, "two")]:
        with pytest.raises(ActionParseError):
            parse(output, ADMISSIBLE)
    with pytest.raises(ActionParseError, match="lists no admissible actions"):
        parse_choice("1", None)


def test_rollout_config_rejects_bad_settings_by_name():
    for bad, match in [(dict(action_format="json"), "action_format='json'"),
                       (dict(history_window=-1), "history_window=-1"),
                       (dict(action_window=-2), "action_window=-2"),
                       (dict(max_prompt_tokens=3), "max_prompt_tokens=3")]:
        with pytest.raises(ValueError, match=match):
            RolloutConfig(**bad)


def alfworld_rollout(config: RolloutConfig, seed: int, value: float = 0.0):
    """A tiny untrained policy plays 2 ALFWorld tasks x 2 rollouts of at most 3 steps;
    its value head says `value` everywhere."""
    tokenizer = build_tokenizer("alfworld")
    model = TransformerPolicy(TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=32,
                                                num_layers=1, num_heads=2, mlp_dim=64),
                              rngs=nnx.Rngs(seed))
    model.value_head.bias[...] = value  # the head starts at zero
    graphdef, state = nnx.split(model)
    envs = [registry.make("alfworld", difficulty=0, max_steps=3) for _ in range(4)]
    with EnvPool(envs) as pool:
        out = collect(graphdef, state, pool, [0, 1], 2, tokenizer, jax.random.key(0), config)
    return graphdef, state, tokenizer, out


@pytest.fixture(scope="module")
def rollout():
    return alfworld_rollout(RolloutConfig(max_prompt_tokens=96, max_action_tokens=6), seed=0)


def test_rollout_records_exact_tokens_and_their_logprobs(rollout):
    graphdef, state, tokenizer, out = rollout
    assert len(out.trajectories) == 4
    assert [t.group_id for t in out.trajectories] == [0, 0, 1, 1]
    for trajectory in out.trajectories:
        assert 1 <= len(trajectory.steps) <= 3
        step = trajectory.steps[0]
        row = np.asarray([list(step.prompt_ids) + list(step.action_ids)], np.int32)
        scores = score_rows(graphdef, state, row, np.ones_like(row, bool))
        n = len(step.prompt_ids)
        # Scoring the stored ids reproduces the sampling log-probs and V(s_t): nothing re-tokenised.
        np.testing.assert_allclose(np.asarray(scores.logprobs)[0, n:], step.action_logp, atol=1e-4)
        np.testing.assert_allclose(float(scores.values[0, n]), step.value, atol=1e-4)
        assert step.reward == pytest.approx(0.0 if step.info["valid"] else -0.1)
    assert 0.0 <= out.metrics["rollout/invalid_action_rate"] <= 1.0


def test_live_rollouts_export_to_the_step_row_schema_without_loss(rollout, tmp_path):
    *_, out = rollout
    path = str(tmp_path / "rollouts.parquet")
    save_trajectories(out.trajectories, path)
    loaded = load_trajectories(path)
    assert len(loaded) == len(out.trajectories)
    for original, back in zip(out.trajectories, loaded):
        assert back.group_id == original.group_id and back.score == pytest.approx(original.score)
        for a, b in zip(original.steps, back.steps):
            assert list(b.prompt_ids) == list(a.prompt_ids)
            assert list(b.observation_ids) == list(a.observation_ids)
            assert list(b.action_ids) == list(a.action_ids)
            np.testing.assert_array_equal(np.float32(b.action_logp), np.float32(a.action_logp))
            assert (b.reward, b.done, b.truncated, b.anchor) == (a.reward, a.done, a.truncated, a.anchor)
            assert dict(b.info) == dataclasses.asdict(a)["info"]


def test_truncated_trajectories_end_with_the_next_value_unless_terminal():
    config = RolloutConfig(max_prompt_tokens=96, max_action_tokens=6)
    *_, out = alfworld_rollout(config, seed=0, value=0.25)
    # The untrained policy runs out of its 3 steps, so the step limit cuts every trajectory.
    assert all(t.steps[-1].truncated for t in out.trajectories)
    assert [t.bootstrap_value for t in out.trajectories] == pytest.approx([0.25] * 4)
    terminal = dataclasses.replace(config, bootstrap_truncated=False)
    *_, same = alfworld_rollout(terminal, seed=0, value=0.25)
    assert [t.bootstrap_value for t in same.trajectories] == [0.0] * 4
    for a, b in zip(out.trajectories, same.trajectories):
        assert [s.action_ids for s in a.steps] == [s.action_ids for s in b.steps]


CHOICE = RolloutConfig(max_prompt_tokens=192, max_action_tokens=6, action_format="choice",
                       history_window=1, action_window=1)


@pytest.fixture(scope="module")
def choice_rollout():
    return alfworld_rollout(CHOICE, seed=1)


def test_constrained_choice_rollouts_pick_only_admissible_actions(choice_rollout):
    graphdef, state, tokenizer, out = choice_rollout
    markers = choice_markers(tokenizer, CHOICE)
    assert markers and CHOICE.action_length == 1
    # An untrained policy already acts validly: every sample is one of the choice tokens on offer.
    assert out.metrics["rollout/invalid_action_rate"] == 0.0
    for trajectory in out.trajectories:
        for step in trajectory.steps:
            assert len(step.action_ids) == 1 and step.info["valid"]
            row = np.asarray([list(step.prompt_ids) + list(step.action_ids)], np.int32)
            scores = score_rows(graphdef, state, row, np.ones_like(row, bool),
                                choice_markers=markers)
            np.testing.assert_allclose(float(scores.logprobs[0, -1]), step.action_logp[0],
                                       atol=1e-4)
    free = dataclasses.replace(CHOICE, constrain_choice=False)
    assert choice_markers(tokenizer, free) == () and free.action_length == 6


def test_later_prompts_show_a_chosen_action_as_its_text(choice_rollout):
    *_, tokenizer, out = choice_rollout
    env = registry.make("alfworld", difficulty=0, max_steps=3)
    checked = 0
    for trajectory in out.trajectories:
        if len(trajectory.steps) < 3:
            continue
        start = env.reset(trajectory.group_id)
        first = parse_choice(tokenizer.decode(trajectory.steps[0].action_ids),
                             start.admissible_actions)
        # The label's list is gone by the next step, so the history names the action itself:
        # in the pair at step 1 and, alone, in the action window at step 2.
        assert f"<act>{first}<eoa><obs>" in tokenizer.decode(trajectory.steps[1].prompt_ids)
        third = tokenizer.decode(trajectory.steps[2].prompt_ids)
        assert third.startswith(f"<bos><task>{start.task}<act>{first}<eoa><obs>")
        checked += 1
    assert checked
