"""The agentic forks' call signatures against loops written from their conventions."""

import re

import numpy as np
import pytest

from stepcredit.compat import agent_r1, arlarena, istar, verl_agent
from tests.compat.batches import Batch, as_input, as_output, close, step_rows, torch
from tests.reference import forks as reference

# ---------------------------------------------------------------- verl-agent


@pytest.mark.parametrize("cross_steps", [True, False])
@pytest.mark.parametrize("name, rule", [("compute_grpo_outcome_advantage", "std"),
                                        ("compute_rloo_outcome_advantage", "rloo"),
                                        ("compute_reinforce_plus_plus_baseline_outcome_advantage", "mean")])
def test_verl_agent_group_members(kind, name, rule, cross_steps):
    d = step_rows(1)
    advantages, returns = getattr(verl_agent, name)(
        as_input(kind, d["rewards"]), as_input(kind, d["mask"]), d["index"], d["traj"],
        compute_mean_std_cross_steps=cross_steps)
    expected = reference.verl_agent_grouped(d["rewards"], d["mask"], d["index"], d["traj"], rule,
                                            cross_steps=cross_steps)
    if rule == "mean":
        expected = reference.masked_whiten(expected, d["mask"]) * d["mask"]
    close(as_output(kind, advantages), expected)
    assert returns is advantages


def test_verl_agent_cross_steps_weighs_long_trajectories():
    """The two member rules differ on the same rows: the flag is read, not ignored."""
    d = step_rows(2)
    across, _ = verl_agent.compute_grpo_outcome_advantage(d["rewards"], d["mask"], d["index"], d["traj"])
    once, _ = verl_agent.compute_grpo_outcome_advantage(d["rewards"], d["mask"], d["index"], d["traj"],
                                                        compute_mean_std_cross_steps=False)
    assert np.abs(across - once).max() > 1e-3


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("similarity", [False, True])
def test_verl_agent_gigpo(kind, mode, similarity):
    d = step_rows(3, episode_reward_on_every_row=True)
    anchors = d["texts"] if similarity else d["anchors"]
    step_rewards = reference.step_discounted_returns(d["rewards"], d["mask"], d["traj"], d["step"], 0.95)
    advantages, _ = verl_agent.compute_gigpo_outcome_advantage(
        as_input(kind, d["rewards"]), as_input(kind, step_rewards.astype(np.float32)),
        as_input(kind, d["mask"]), anchors, d["index"], d["traj"], step_advantage_w=0.7, mode=mode,
        enable_similarity=similarity, similarity_thresh=0.9)
    expected = reference.verl_agent_gigpo(d["rewards"], step_rewards, d["mask"], anchors, d["index"],
                                          d["traj"], weight=0.7, mode=mode, similarity=similarity,
                                          threshold=0.9)
    close(as_output(kind, advantages), expected, atol=1e-4)


def test_build_step_group_matches_the_greedy_rule_and_never_crosses_uids():
    d = step_rows(4)
    for similarity in (False, True):
        anchors = d["texts"] if similarity else d["anchors"]
        ids = verl_agent.build_step_group(anchors, d["index"], similarity, 0.85)
        labels = reference.build_step_group(list(anchors), list(d["index"]), similarity, 0.85)
        pairs = set(zip(ids, labels))
        assert len(pairs) == len(set(ids)) == len(set(labels))  # the same partition
    vectors = np.array([[1, 2], [1, 2], [3, 4]], dtype=object)  # one array-like observation per row
    assert len(set(verl_agent.build_step_group(vectors, np.array(["u"] * 3, dtype=object)))) == 2
    with pytest.raises(ValueError, match="similarity_thresh"):
        verl_agent.build_step_group(d["texts"], d["index"], True, 1.0)
    with pytest.raises(ValueError, match="anchor_obs has 3 entries but index has"):
        verl_agent.build_step_group(d["anchors"][:3], d["index"])


def test_verl_agent_step_returns_follow_batch_order(kind):
    d = step_rows(5)
    env_rewards = np.random.default_rng(5).integers(0, 3, len(d["index"])).astype(np.float32)
    batch = Batch({"input_ids": np.zeros((len(env_rewards), 3), np.int64)},
                  {"rewards": env_rewards, "traj_uid": d["traj"],
                   "active_masks": np.ones(len(env_rewards), bool)})
    returns = verl_agent.compute_step_discounted_returns(batch, gamma=0.9)
    close(returns.numpy(), reference.batch_order_returns(env_rewards, d["traj"], 0.9))
    batch.non_tensor_batch["active_masks"][3] = False
    with pytest.raises(ValueError, match="row 3 .* inactive"):
        verl_agent.compute_step_discounted_returns(batch, gamma=0.9)


def test_verl_agent_gae_runs_over_every_position(kind):
    d = step_rows(6)
    advantages, returns = verl_agent.compute_gae_advantage_return(
        as_input(kind, d["rewards"]), as_input(kind, d["values"]), as_input(kind, d["mask"]), 0.9, 0.8)
    ones = np.ones_like(d["mask"])
    _, expected_returns = reference.token_gae(d["rewards"], d["values"], ones, np.arange(len(ones)),
                                              np.zeros(len(ones), int), 0.9, 0.8)
    close(as_output(kind, returns), expected_returns)
    expected = reference.masked_whiten(expected_returns - d["values"], d["mask"])
    valid = d["mask"] > 0
    close(as_output(kind, advantages)[valid], expected[valid])


# ---------------------------------------------------------------- Agent-R1 / StepPO


def test_agent_r1_step_and_token_gae(kind):
    d = step_rows(7)
    args = (as_input(kind, d["rewards"]), as_input(kind, d["values"]), as_input(kind, d["mask"]),
            d["traj"], d["step"])
    advantages, returns = agent_r1.compute_gae_advantage_return(*args, gamma=0.95, lam=0.9)
    expected = reference.step_gae(d["rewards"], d["values"], d["mask"], d["traj"], d["step"], 0.95, 0.9)
    close(as_output(kind, advantages), expected[0], atol=1e-4)
    close(as_output(kind, returns), expected[1])
    advantages, returns = agent_r1.compute_token_gae_advantage_return(*args, gamma=0.95, lam=0.9)
    expected = reference.token_gae(d["rewards"], d["values"], d["mask"], d["traj"], d["step"], 0.95, 0.9)
    close(as_output(kind, advantages), expected[0], atol=1e-4)
    close(as_output(kind, returns), expected[1])


@pytest.mark.parametrize("name, rule", [("compute_grpo_outcome_advantage", "std"),
                                        ("compute_rloo_outcome_advantage", "rloo"),
                                        ("compute_reinforce_plus_plus_baseline_outcome_advantage", "mean")])
def test_agent_r1_trajectory_members(kind, name, rule):
    d = step_rows(8)
    advantages, _ = getattr(agent_r1, name)(as_input(kind, d["rewards"]), as_input(kind, d["mask"]),
                                            d["index"], d["traj"])
    expected = reference.agent_r1_grouped(d["rewards"], d["mask"], d["index"], d["traj"], rule)
    if rule == "mean":
        expected = reference.masked_whiten(expected, d["mask"]) * d["mask"]
    close(as_output(kind, advantages), expected)


def test_agent_r1_gigpo_and_step_returns(kind):
    d = step_rows(9)
    returns = agent_r1.compute_step_discounted_returns(
        as_input(kind, d["rewards"]), as_input(kind, d["mask"]), d["traj"], d["step"], gamma=0.9)
    step_rewards = reference.step_discounted_returns(d["rewards"], d["mask"], d["traj"], d["step"], 0.9)
    close(as_output(kind, returns), step_rewards)
    advantages, _ = agent_r1.compute_gigpo_outcome_advantage(
        as_input(kind, d["rewards"]), returns, as_input(kind, d["mask"]), d["anchors"], d["index"],
        d["traj"])
    close(as_output(kind, advantages),
          reference.agent_r1_gigpo(d["rewards"], step_rewards, d["mask"], d["anchors"], d["index"],
                                   d["traj"]), atol=1e-4)


@pytest.mark.parametrize("bad, said", [("x", "gamma='x'; it must be a number"),
                                       (None, "gamma=None; it must be a number"),
                                       (True, "gamma=True; it must be a number"),
                                       (np.array([0.9, 0.8]), "gamma=array"),
                                       (float("nan"), "gamma=nan; it must be finite")])
def test_a_hyperparameter_that_is_not_a_number_is_named(bad, said):
    d = step_rows(0)
    args = (d["rewards"], d["values"], d["mask"], d["traj"], d["step"])
    with pytest.raises(ValueError, match=re.escape(f"compute_gae_advantage_return: {said}")):
        agent_r1.compute_gae_advantage_return(*args, gamma=bad, lam=1.0)
    said = said.replace("gamma", "epsilon")
    with pytest.raises(ValueError, match=re.escape(f"compute_grpo_outcome_advantage: {said}")):
        verl_agent.compute_grpo_outcome_advantage(d["rewards"], d["mask"], d["index"], d["traj"],
                                                  epsilon=bad)
    gigpo = (d["rewards"], d["rewards"].sum(1), d["mask"], d["anchors"], d["index"], d["traj"])
    with pytest.raises(ValueError, match=re.escape(f"compute_gigpo_outcome_advantage: {said}")):
        verl_agent.compute_gigpo_outcome_advantage(*gigpo, epsilon=bad)
    # A setting is read only where it is used: no threshold without clustering.
    verl_agent.compute_gigpo_outcome_advantage(*gigpo, similarity_thresh=None)
    istar.compute_istar_rloo_advantage(_istar_batch(d), step_advantage_w=None,
                                       use_process_only=True)
    # A config's string, as YAML reads "1e-6", and a one-element tensor are numbers.
    expected = agent_r1.compute_gae_advantage_return(*args, gamma=0.9, lam=1.0)
    close(agent_r1.compute_gae_advantage_return(*args, gamma="0.9", lam=torch.tensor(1.0))[0],
          expected[0])


def test_agent_r1_rejects_a_gap_in_step_indices():
    d = step_rows(10)
    steps = d["step"].copy()
    steps[np.flatnonzero(steps == 1)[0]] = 3
    with pytest.raises(ValueError, match=r"step_indices.*must run 0, 1"):
        agent_r1.compute_gae_advantage_return(d["rewards"], d["values"], d["mask"], d["traj"], steps, 1, 1)


# ---------------------------------------------------------------- ARLArena


@pytest.mark.parametrize("cross_steps", [True, False])
def test_arlarena_grpo_means_a_trajectory_rows(kind, cross_steps):
    d = step_rows(11)
    advantages, _ = arlarena.compute_grpo_outcome_advantage(
        as_input(kind, d["rewards"]), as_input(kind, d["mask"]), d["index"], d["traj"],
        compute_mean_std_cross_steps=cross_steps)
    close(as_output(kind, advantages),
          reference.arlarena_grpo(d["rewards"], d["mask"], d["index"], d["traj"], cross_steps=cross_steps))


@pytest.mark.parametrize("steps_from", ["step_indices", "raw_prompt"])
def test_arlarena_empg_on_a_batch(steps_from):
    d = step_rows(12)
    base, _ = arlarena.compute_grpo_outcome_advantage(d["rewards"], d["mask"], d["index"], d["traj"])
    non_tensors = {"traj_uid": d["traj"]}
    if steps_from == "step_indices":
        non_tensors["step_indices"] = d["step"]
    else:
        prompts = np.empty(len(d["step"]), dtype=object)
        prompts[:] = [[{"role": "user", "content": f"... you have already taken {s} step(s) ..."}]
                      for s in d["step"]]
        non_tensors["raw_prompt"] = prompts
    batch = Batch({"advantages": base, "old_entropy": d["entropy"], "response_mask": d["mask"]},
                  non_tensors)
    advantages, _ = arlarena.compute_EMPG_advantage(batch, k=1.0, k_f=1.0, zeta=0.05)
    filled = np.repeat(base[:, :1], base.shape[1], 1)  # column 0 is always masked in
    close(advantages.numpy(), reference.empg(filled, d["entropy"], d["mask"], d["traj"], d["step"]))


# ---------------------------------------------------------------- iStar


def _istar_batch(d):
    return Batch({"token_level_rewards": d["rewards"], "rm_scores": d["rm_scores"],
                  "response_mask": d["mask"]},
                 {"uid": d["index"], "traj_uid": d["traj"], "step_indices": d["step"]})


@pytest.mark.parametrize("baseline", ["first_step", "batch_order", "all_steps"])
def test_istar_rloo_and_grpo(baseline):
    d = step_rows(13, episode_reward_on_every_row=True)
    batch = _istar_batch(d)
    steps = None if baseline == "batch_order" else d["step"]
    args = (d["rewards"], d["rm_scores"], d["mask"], d["index"], d["traj"])
    advantages, _ = istar.compute_istar_rloo_advantage(batch, step_advantage_w=0.5, step_baseline=baseline)
    close(advantages.numpy(), reference.istar(*args, weight=0.5, rule="rloo", step_index=steps,
                                              all_steps=baseline == "all_steps"))
    advantages, _ = istar.compute_istar_rloo_advantage(batch, use_process_only=True, step_baseline=baseline)
    close(advantages.numpy(), reference.istar(*args, step_index=steps, all_steps=baseline == "all_steps",
                                              process_only=True))
    for mode, rule in (("mean_norm", "mean"), ("mean_std_norm", "std")):
        advantages, _ = istar.compute_istar_grpo_advantage(batch, mode=mode, step_baseline=baseline)
        close(advantages.numpy(), reference.istar(*args, rule=rule, step_index=steps,
                                                  all_steps=baseline == "all_steps"), atol=1e-4)


def test_istar_batch_order_changes_when_rows_move_and_first_step_does_not():
    d = step_rows(14)
    first_rows = {t: i for i, t in reversed(list(enumerate(d["traj"])))}
    moved = np.arange(len(d["traj"]))
    # move a later step of a multi-step trajectory ahead of its step-0 row
    traj = next(t for t in first_rows if (d["traj"] == t).sum() > 1)
    rows = np.flatnonzero(d["traj"] == traj)
    zero = rows[d["step"][rows] == 0][0]
    later = rows[d["step"][rows] > 0][0]
    moved[[zero, later]] = moved[[later, zero]]
    shuffled = {k: v[moved] for k, v in d.items()}
    for baseline, changes in (("batch_order", True), ("first_step", False)):
        a, _ = istar.compute_istar_rloo_advantage(_istar_batch(d), step_baseline=baseline)
        b, _ = istar.compute_istar_rloo_advantage(_istar_batch(shuffled), step_baseline=baseline)
        moved_back = b.numpy()[np.argsort(moved)]
        assert (np.abs(a.numpy() - moved_back).max() > 1e-4) == changes, baseline


def test_istar_messages():
    d = step_rows(15)
    batch = _istar_batch(d)
    del batch.non_tensor_batch["step_indices"]
    with pytest.raises(KeyError, match="step_baseline='batch_order'"):
        istar.compute_istar_rloo_advantage(batch)
    batch = _istar_batch(d)
    batch.batch["rm_scores"] = batch.batch["rm_scores"][:, 0]
    with pytest.raises(ValueError, match=r"rm_scores has shape \(\d+,\); it must be \(bs, response_length\)"):
        istar.compute_istar_rloo_advantage(batch)
    merged, _ = istar.process_outcome_combined_advantage(_istar_batch(d), step_advantage_w=1.0)
    close(merged.numpy(), reference.istar(d["rewards"] + d["rm_scores"], np.zeros_like(d["rm_scores"]),
                                          d["mask"], d["index"], d["traj"], step_index=d["step"]))


def test_step_index_messages():
    d = step_rows(16)
    batch = _istar_batch(d)
    batch.non_tensor_batch["step_indices"] = d["step"][:-1]
    with pytest.raises(ValueError, match=r"step_indices has \d+ entries for \d+ rows"):
        istar.compute_istar_rloo_advantage(batch)
    batch = _istar_batch(d)
    steps = d["step"].astype(np.float64)
    steps[np.flatnonzero(steps > 0)[0]] += 0.5
    batch.non_tensor_batch["step_indices"] = steps
    with pytest.raises(ValueError, match=r"step_indices holds \d\.5 at row \d+; steps are whole numbers"):
        istar.compute_istar_rloo_advantage(batch)
    batch = _istar_batch(d)
    batch.non_tensor_batch["step_indices"] = d["step"].astype(str)  # "1" is text, not a step
    with pytest.raises(TypeError, match="step_indices holds text such as '0'; steps are numbers"):
        istar.compute_istar_rloo_advantage(batch)
    batch = _istar_batch(d)
    batch.non_tensor_batch["step_indices"] = d["step"].astype(object)  # verl's object arrays pass
    np.testing.assert_allclose(istar.compute_istar_rloo_advantage(batch)[0].numpy(),
                               istar.compute_istar_rloo_advantage(_istar_batch(d))[0].numpy())
    batch = _istar_batch(d)
    steps = d["step"].copy()
    steps[np.flatnonzero(steps > 0)[0]] = 0
    batch.non_tensor_batch["step_indices"] = steps
    with pytest.raises(ValueError, match="step_indices 0 on two rows"):
        istar.compute_istar_rloo_advantage(batch)
    base, _ = arlarena.compute_grpo_outcome_advantage(d["rewards"], d["mask"], d["index"], d["traj"])
    prompts = np.empty(len(d["step"]), dtype=object)
    prompts[:] = [[{"role": "user", "content": "no step count here"}]] * len(d["step"])
    batch = Batch({"advantages": base, "old_entropy": d["entropy"], "response_mask": d["mask"]},
                  {"traj_uid": d["traj"], "raw_prompt": prompts})
    with pytest.raises(ValueError, match=r"step 0 on two rows \(the step read from raw_prompt"):
        arlarena.compute_EMPG_advantage(batch)
    batch.non_tensor_batch["raw_prompt"] = np.asarray(["a plain string"] * len(d["step"]), object)
    with pytest.raises(ValueError, match=r"raw_prompt\[0\] is str 'a plain string'; it must be"):
        arlarena.compute_EMPG_advantage(batch)
    batch.non_tensor_batch["raw_prompt"] = prompts
    batch.non_tensor_batch["step_indices"] = d["step"]
    batch.batch["advantages"] = base[:, 0]
    with pytest.raises(ValueError, match=r"advantages has shape \(\d+,\) and response_mask"):
        arlarena.compute_EMPG_advantage(batch)
    with pytest.raises(ValueError, match=r"step_norm_reward: response_mask has shape \(\d+,\)"):
        verl_agent.step_norm_reward(d["rewards"].sum(1), d["mask"][:, 0], d["index"])
