"""A regression museum: the credit bugs reported in the peers' advantage code, as tests.

Each test is named after the report, builds the small case that exposed the bug and
asserts stepcredit's answer (computed by hand in the test, or by a plain loop from
`tests/reference`). Where it helps, the peer's wrong computation is reproduced as a plain
loop next to it, so the museum shows both the exhibit and the right answer.
"""

import types

import jax.numpy as jnp
import numpy as np

from stepcredit import StepRecord, Trajectory, advantages as adv, collate
from stepcredit.advantages import CreditInputs
from stepcredit.credit import compute_advantages, token_rewards_from_steps
from stepcredit.train.rows import build_rows, length_groups, rows_from_tokens, tokens_from_rows
from tests.reference import gae as gae_ref
from tests.reference import gigpo as gigpo_ref
from tests.reference import group as group_ref

NAN = np.nan


def _f32(x):
    return np.asarray(x, np.float32)


def _step(action, reward=0.0, *, observation=(1,), prompt=None, done=False):
    return StepRecord(observation_ids=list(observation), action_ids=list(action),
                      action_logp=[-0.5] * len(action), reward=reward, done=done,
                      prompt_ids=None if prompt is None else list(prompt))


def _unmasked_value_gae(rewards, values, gamma, lam):
    """GAE over every position, reading the next position's value whatever the mask (the
    peers' loops before the fixes: ROLL before pull request 447, miles before 1827)."""
    advantages, running = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


# --------------------------------------------------------------------------- GAE and masks

def test_roll_pr_447_masked_values_do_not_bootstrap_gae():
    """ROLL's `compute_advantage` masked the stored critic values but passed the unmasked
    ones to GAE, so a padding slot's value (100) bootstrapped the valid tokens before it:
    advantages [5.7, 6.0] for rewards [0, 1]. Masked positions must neither bootstrap nor
    advance the recursion: with gamma 1, lam 0.95 the advantages (and, the values being 0,
    the returns) are [0.95, 1.0], whatever the masked slot holds, NaN included."""
    rewards, mask = _f32([[0.0, 1.0, 0.0]]), np.array([[True, True, False]])
    exhibit = _unmasked_value_gae([0.0, 1.0, 0.0], [0.0, 0.0, 100.0], 1.0, 0.95)
    np.testing.assert_allclose(exhibit[:2], [5.7, 6.0], atol=1e-6)
    for masked_value in (100.0, NAN):
        values = _f32([[0.0, 0.0, masked_value]])
        for estimator in (adv.token_gae, adv.step_gae):
            for method in ("sequential", "chunked"):
                out = estimator(rewards, values, mask, gamma=1.0, lam=0.95, method=method)
                np.testing.assert_allclose(out.advantages, [[0.95, 1.0, 0.0]], atol=1e-6)
                np.testing.assert_allclose(out.returns, [[0.95, 1.0, 0.0]], atol=1e-6)
    # The registry path reads the same arrays (step view: masked step value 100).
    out = adv.apply("step_gae", CreditInputs(mask=mask, step_rewards=rewards,
                                             step_values=_f32([[0.0, 0.0, 100.0]])),
                    {"lam": 0.95})
    np.testing.assert_allclose(out.advantages, [[0.95, 1.0, 0.0]], atol=1e-6)


def test_miles_pr_1827_reward_on_masked_observation_token_is_not_decayed_or_lost():
    """miles put the terminal reward on the last response token even when that token was a
    masked environment observation, and ran GAE over every token: the reward reached the
    trainable tokens only after (gamma lam)^gap decay, and with gamma 0 it was lost; masked
    tokens' KL rewards and values also leaked in. The right answer puts each step's reward
    on its last action token and runs GAE over action tokens only, one gamma lam per action
    transition; masked tokens carry no reward and no value."""
    # Step 0: actions at 0-1; observation at 2-3; step 1: action at 4; final observation 5-6.
    step_index = np.array([[0, 0, -1, -1, 1, -1, -1]], np.int32)
    step_rewards, mask = _f32([[0.0, 1.0]]), np.array([[True, True]])
    np.testing.assert_allclose(token_rewards_from_steps(step_rewards, step_index),
                               [[0, 0, 0, 0, 1, 0, 0]])
    values = _f32([[0.0, 0.0, 100.0, NAN, 0.0, 100.0, NAN]])  # observations hold anything
    inputs = CreditInputs(mask=mask, step_rewards=step_rewards, step_index=step_index,
                          token_values=values)

    out = adv.apply("token_gae", inputs, {"gamma": 0.9, "lam": 0.9})
    np.testing.assert_allclose(out.advantages, [[0.6561, 0.81, 0, 0, 1.0, 0, 0]], atol=1e-6)
    out = adv.apply("token_gae", inputs, {"gamma": 0.0, "lam": 0.9})
    np.testing.assert_allclose(out.advantages, [[0, 0, 0, 0, 1.0, 0, 0]], atol=1e-6)

    # A KL-shaped reward on the masked tokens changes nothing: they carry no reward.
    shaped = _f32([[0.0, 0.0, -5.0, -5.0, 1.0, -5.0, -5.0]])
    out = adv.apply("token_gae", inputs._replace(token_rewards=shaped), {"gamma": 0.9, "lam": 0.9})
    np.testing.assert_allclose(out.advantages, [[0.6561, 0.81, 0, 0, 1.0, 0, 0]], atol=1e-6)

    # The exhibit: reward on the final (masked) token, GAE over every token with zero values.
    rewards_on_last = [0, 0, 0, 0, 0, 0, 1.0]
    old = _unmasked_value_gae(rewards_on_last, [0.0] * 7, 0.9, 0.9)
    np.testing.assert_allclose(old[4], 0.81**2, atol=1e-6)  # decayed over the 2 observations
    assert _unmasked_value_gae(rewards_on_last, [0.0] * 7, 0.0, 0.9)[4] == 0.0  # lost


def _action_token_values(step_index):
    """0.1 (t + 1) + 0.01 k at the k-th action token of step t; NaN off the action tokens."""
    values = np.full(step_index.shape, NAN, np.float32)
    for b, row in enumerate(step_index):
        seen = {}
        for n, t in enumerate(row):
            if t >= 0:
                k = seen.get(t, 0)
                values[b, n], seen[t] = 0.1 * (t + 1) + 0.01 * k, k + 1
    return values


def test_verl_pr_2337_observation_tokens_are_masked_in_multi_turn_gae():
    """verl's multi-turn GAE ran over the whole response, tool and environment observation
    tokens included, so observations took part in the recursion (their values bootstrapped,
    each added a gamma lam decay). With observations masked, the action tokens must get the
    advantages of GAE over the action tokens alone: a token view with the observations in
    it and one without give the same credit, and observation tokens get 0."""
    trajectories = [
        Trajectory(steps=[_step([10, 11], observation=[1, 2, 3]),
                          _step([12, 13, 14], 1.0, observation=[4, 5], done=True)], group_id=0),
        Trajectory(steps=[_step([15], 0.5, observation=[6], done=True)], group_id=0),
    ]
    gamma, lam = 0.9, 0.8
    credit = {}
    for with_observations in (True, False):
        steps, tokens, _ = collate(trajectories, with_observations=with_observations)
        action = tokens.step_index >= 0
        values = _action_token_values(tokens.step_index)
        raw, whitened = (np.asarray(compute_advantages(
            steps, tokens, "token_gae", token_values=values, gamma=gamma, lam=lam,
            whiten=whiten).token_advantages) for whiten in (False, None))
        assert np.all(raw[~action] == 0) and np.all(whitened[~action] == 0)
        credit[with_observations] = raw[action], whitened[action]  # row by row, in order
    # Both views give the same credit, raw and whitened over the action tokens.
    np.testing.assert_allclose(credit[True][0], credit[False][0], atol=1e-6)
    np.testing.assert_allclose(credit[True][1], credit[False][1], atol=1e-5)

    # The reference: GAE along each trajectory's action tokens alone (rewards on each step's
    # last action token), and the exhibit: the view with observations run as transitions.
    steps, tokens, _ = collate(trajectories, with_observations=True)
    values = np.nan_to_num(_action_token_values(tokens.step_index))  # observations: value 0
    rewards = np.asarray(token_rewards_from_steps(steps.reward, tokens.step_index))
    action = tokens.step_index >= 0
    expected = np.concatenate([gae_ref.gae_row(rewards[b][action[b]], values[b][action[b]],
                                               np.ones(action[b].sum(), bool), gamma, lam)[0]
                               for b in range(len(trajectories))])
    np.testing.assert_allclose(credit[True][0], expected, atol=1e-6)
    unmasked = np.concatenate([gae_ref.gae_row(rewards[b], values[b], np.ones(len(values[b]), bool),
                                               gamma, lam)[0][action[b]]
                               for b in range(len(trajectories))])
    assert np.abs(unmasked - expected).max() > 0.05


def test_verl_issue_7278_reinforce_pp_return_crosses_observation_spans():
    """verl's REINFORCE++ reset its running return at every response_mask 0, so in a
    multi-turn response the tool-observation tokens cut the return and the outcome reward
    reached the last assistant turn only. The return must cross observation spans and
    reset only at padding: with gamma 1 every action token of the episode gets the
    outcome 1, whether or not the token view holds the observations."""
    trajectories = [Trajectory(steps=[_step([10, 11], observation=[1, 2]),
                                      _step([12, 13], 1.0, observation=[3, 4], done=True)])]
    for with_observations in (False, True):
        steps, tokens, _ = collate(trajectories, with_observations=with_observations)
        credit = compute_advantages(steps, tokens, "reinforce_pp", whiten=False)
        np.testing.assert_allclose(np.asarray(credit.token_advantages)[tokens.step_index >= 0],
                                   [1.0, 1.0, 1.0, 1.0], atol=1e-6)


# ---------------------------------------------------------------- the trainer's data layout

def test_verl_pr_1440_value_mask_stays_aligned_under_dynamic_batching(monkeypatch):
    """verl's critic rearranged the rows into dynamic micro-batches, computed values in that
    order and multiplied them by the attention mask still in the original order, before
    restoring the order: every value was masked by another row's mask. stepcredit's learner
    scores rows in length groups (`Learner.score`), restores the order, and only then
    scatters values into the token view with each row's own action mask
    (`tokens_from_rows`) and builds the critic targets' mask (`_value_targets`)."""
    from stepcredit.models.transformer import RowScores
    from stepcredit.train import learn

    # Rows of lengths 42, 4, 23, 51: length groups of two reorder them (rows 1, 2 | 0, 3).
    trajectories = [
        Trajectory(steps=[_step([10, 11], prompt=[3] * 40), _step([12], 1.0, prompt=[3] * 3,
                                                                    done=True)]),
        Trajectory(steps=[_step([13, 14, 15], prompt=[4] * 20),
                          _step([16], 0.5, prompt=[4] * 50, done=True)]),
    ]
    rows, index = build_rows(trajectories, num_steps=2, row_length=96, pad_id=0, multiple=2)
    steps, tokens, _ = collate(trajectories, max_steps=2, with_observations=False)
    shape = tokens.tokens.shape

    def fake_score(params, row_tokens, mask, action_mask, temperature, *, graphdef,
                   choice_markers, width, shared, label_slots):
        # A critic whose value at an action token is that token's id; garbage elsewhere.
        garbage = 1000.0 + jnp.arange(row_tokens.shape[1], dtype=jnp.float32)
        values = jnp.where(action_mask, row_tokens.astype(jnp.float32), garbage)
        zeros = jnp.zeros(row_tokens.shape, jnp.float32)
        return RowScores(logprobs=zeros, entropies=zeros, values=values)

    config = types.SimpleNamespace(
        estimator_config={}, minibatch_rows=2, share_contexts=True,
        rollout=types.SimpleNamespace(max_prompt_tokens=90, action_length=6),
        loss=types.SimpleNamespace(temperature=1.0, choice_markers=(), action_width=None,
                                   value_coef=0.5))
    learner = learn.Learner(types.SimpleNamespace(config=config, graphdef=None,
                                                  estimator=adv.get("step_gae")), None)
    monkeypatch.setattr(learn.update, "score", fake_score)
    scored = learner.score(None, rows)

    # The exhibit: the values in length-group order, masked by the rows in their own order.
    order = np.concatenate([chunk for chunk, _ in length_groups(rows.mask.sum(1), 2,
                                                                limit=rows.tokens.shape[1])])
    assert order.tolist() != sorted(order.tolist())  # the groups do reorder the rows
    misaligned = np.asarray(scored.values)[order] * rows.action_mask
    assert not np.array_equal(misaligned, np.where(rows.action_mask, scored.values, 0.0))

    token_values = np.asarray(tokens_from_rows(scored.values, index, rows.action_mask, shape))
    np.testing.assert_array_equal(token_values[tokens.action_mask],
                                  tokens.tokens[tokens.action_mask].astype(np.float32))
    assert np.all(token_values[~tokens.action_mask] == 0)

    # Critic targets: per step (step GAE) at each row's first action token, per token (token
    # GAE) at its action tokens; each row's mask is its own.
    step_credit = compute_advantages(steps, tokens, "step_gae", lam=0.9)
    targets, value_mask = learner._value_targets(step_credit, rows, index)
    returns = np.asarray(step_credit.returns)
    for r in range(int(rows.valid.sum())):
        mask_row = np.asarray(value_mask)[r]
        assert mask_row.sum() == 1 and mask_row[rows.first_action[r]]
        np.testing.assert_allclose(np.asarray(targets)[r][rows.first_action[r]],
                                   returns[rows.trajectory[r], rows.step[r]], atol=1e-6)
    token_credit = compute_advantages(steps, tokens, "token_gae", token_values=token_values)
    targets, value_mask = learner._value_targets(token_credit, rows, index)
    np.testing.assert_array_equal(np.asarray(value_mask), rows.action_mask & rows.valid[:, None])
    np.testing.assert_allclose(np.asarray(tokens_from_rows(targets, index, value_mask, shape)),
                               np.asarray(token_credit.returns), atol=1e-6)


def test_miles_issue_2378_an_episode_counts_once_however_many_rows_it_has():
    """miles normalised GRPO rewards over training rows, so a rollout split into several
    trajectories (rows) entered the group statistics once per row: rollout A (reward 1, two
    rows) and rollout B (0.5, one row) gave a mean of 0.8333. Each episode must count once:
    mean 0.75, advantages +0.25 on every row and token of A and -0.25 on B's. In stepcredit
    an episode is one `Trajectory` with one score (`collate`), whatever its step rows."""
    trajectories = [
        Trajectory(steps=[_step([10, 11], 0.0, prompt=[1, 2]),
                          _step([12], 1.0, prompt=[1, 2, 3], done=True)], group_id=5),
        Trajectory(steps=[_step([13, 14], 0.5, prompt=[1, 2], done=True)], group_id=5),
    ]
    steps, tokens, _ = collate(trajectories, max_steps=2, with_observations=False)
    np.testing.assert_allclose(steps.score, [1.0, 0.5])
    rows, index = build_rows(trajectories, num_steps=2, row_length=32, pad_id=0, multiple=1)
    assert rows.trajectory.tolist() == [0, 0, 1]
    # The exhibit: statistics over the rows' rewards [1, 1, 0.5].
    row_rewards = np.asarray([1.0, 1.0, 0.5])
    assert abs(row_rewards.mean() - 0.8333) < 1e-4

    expected = {"drgrpo": (0.25, -0.25), "rloo": (0.5, -0.5),
                "grpo": (0.25 / (np.sqrt(0.125) + 1e-6), -0.25 / (np.sqrt(0.125) + 1e-6))}
    for name, (a, b) in expected.items():
        credit = compute_advantages(steps, tokens, name)
        on_rows = np.asarray(rows_from_tokens(credit.token_advantages, index, rows.action_mask))
        np.testing.assert_allclose(on_rows[rows.action_mask], [a, a, a, b, b], atol=1e-5)


# ----------------------------------------------------------------------- normalisation

GROUP_RELATIVE = ("grpo", "drgrpo", "rloo", "gigpo", "empg", "grpo+empg", "dapo+empg",
                  "istar", "rloo+istar", "grpo+istar")


def test_gem_pr_113_group_advantages_are_normalised_once():
    """GEM's GRPO script normalised rewards within each group on the actor and then, with
    norm_return on, whitened the advantages again over all transitions of the batch: two
    normalisations at two granularities, coupling every group to the batch. Group-relative
    advantages must be normalised once: `compute_advantages` returns GRPO's (and RLOO's,
    Dr. GRPO's) group values on every action token unchanged, and no group-relative
    registry entry carries a second whitening."""
    for name in GROUP_RELATIVE:
        assert adv.get(name).whiten == "none", name
    # Group 7: scores 1, 0; group 9: scores 1, 0, 0; trajectories of 1 to 3 steps.
    rewards = [[1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0, 0.0], [0.0]]
    group_ids = [7, 7, 9, 9, 9]
    trajectories = [Trajectory(steps=[_step([20 + t] * (t + 1), r, done=t == len(rs) - 1)
                                      for t, r in enumerate(rs)], group_id=g)
                    for rs, g in zip(rewards, group_ids)]
    steps, tokens, _ = collate(trajectories, with_observations=False)
    scores = [sum(r) for r in rewards]
    references = {"grpo": group_ref.grpo(scores, group_ids),
                  "rloo": group_ref.rloo(scores, group_ids),
                  "drgrpo": group_ref.grpo(scores, group_ids, std="none")}
    np.testing.assert_allclose(references["grpo"],
                               [0.70711, -0.70711, 1.1547, -0.57735, -0.57735], atol=1e-4)
    for name, reference in references.items():
        credit = np.asarray(compute_advantages(steps, tokens, name).token_advantages)
        expected = np.where(tokens.action_mask, reference[:, None], 0.0)
        np.testing.assert_allclose(credit, expected, atol=1e-5)
        # The exhibit: a second whitening over the batch's tokens moves the values.
        twice = np.asarray(adv.masked_whiten(credit, tokens.action_mask))
        assert np.abs(twice - expected)[tokens.action_mask].max() > 0.05


def test_tinker_cookbook_issues_135_and_579_group_std_and_the_g_minus_1_over_g_factor():
    """tinker-cookbook centres each reward on its group's mean, a mean that holds the
    reward itself: pull request 135 showed that this shrinks the expected policy gradient
    by (G-1)/G (the leave-one-out baseline, G/(G-1) (s - mean), has none), and issue 579
    asked why it skips GRPO's division by the group std. Each convention must be what it
    says: on a Bernoulli bandit with G = 4 the exact expected gradient is (G-1)/G p(1-p)
    for Dr. GRPO's centring and p(1-p) for RLOO; GRPO divides by the Bessel-corrected std
    (std="unbiased") or the population one (std="biased"), a ratio of sqrt(G/(G-1))."""
    group = 4
    inputs = CreditInputs(scores=_f32([1.0, 0.0, 0.0, 0.0]), group_ids=np.zeros(group, np.int32))
    centred = np.array([0.75, -0.25, -0.25, -0.25])

    def run(name, config=None, scores=None):
        given = inputs if scores is None else inputs._replace(scores=_f32(scores))
        return np.asarray(adv.apply(name, given, config).advantages, np.float64)

    np.testing.assert_allclose(run("drgrpo"), centred, atol=1e-6)
    np.testing.assert_allclose(run("reinforce_pp_baseline"), centred, atol=1e-6)
    np.testing.assert_allclose(run("rloo"), centred * group / (group - 1), atol=1e-6)
    unbiased, biased = run("grpo", {"eps": 0.0}), run("grpo", {"eps": 0.0, "std": "biased"})
    np.testing.assert_allclose(unbiased, centred / 0.5, atol=1e-5)  # sqrt(0.75 / 3)
    np.testing.assert_allclose(biased, centred / (np.sqrt(3) / 4), atol=1e-5)  # sqrt(0.75 / 4)
    np.testing.assert_allclose(biased / unbiased, np.sqrt(group / (group - 1)), atol=1e-5)
    np.testing.assert_allclose(run("grpo"), centred / (0.5 + 1e-6), atol=1e-6)  # verl's eps

    # The (G-1)/G factor, exactly: action 1 (reward 1) has probability p = sigmoid(theta), so
    # d E[r] / d theta = p (1 - p); d log pi / d theta is 1 - p for action 1 and -p for 0.
    p = 0.3
    outcomes = [np.array([(k >> i) & 1 for i in range(group)], float) for k in range(2**group)]
    for name, factor in (("drgrpo", (group - 1) / group), ("rloo", 1.0)):
        gradient = sum(np.prod(np.where(a == 1, p, 1 - p))
                       * np.mean(run(name, scores=a) * np.where(a == 1, 1 - p, -p))
                       for a in outcomes)
        np.testing.assert_allclose(gradient, factor * p * (1 - p), atol=1e-7)


# ----------------------------------------------------------------------- grouping steps

def test_mem_alpha_issue_14_steps_are_grouped_by_state_not_by_step_index():
    """Mem-alpha normalised step rewards across the rollouts at the same step index t, but
    after different earlier actions the rollouts sit in different states at step t, so
    their rewards are not comparable. Steps must be grouped by the state they act from:
    GiGPO's anchor groups compare the steps taken from one state whatever their index, and
    leave a state visited once ungrouped (step advantage 0)."""
    # Three rollouts of one task (gamma 0.5, std "none") and a padding row (no valid step:
    # left out of its group). States: rollout 0 goes 0 -> 1, rollout 1 goes 0 -> 2,
    # rollout 2 goes 0 -> 0 -> 1 (it reaches state 1 at step 2).
    step_rewards = _f32([[0.0, 1.0, NAN], [0.0, 0.0, NAN], [0.0, 0.0, 0.0], [NAN] * 3])
    anchors = np.array([[0, 1, -1], [0, 2, -1], [0, 0, 1], [-1] * 3], np.int32)
    mask = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]], bool)
    group_ids = np.zeros(4, np.int32)
    out = adv.apply("gigpo", CreditInputs(mask=mask, step_rewards=step_rewards, anchors=anchors,
                                          group_ids=group_ids), {"gamma": 0.5, "std": "none"})
    # Episode: scores 1, 0, 0 (mean 1/3). Returns [0.5, 1], [0, 0], [0, 0, 0]. State 0 holds
    # 0.5, 0, 0, 0 (mean 0.125); state 1 holds 1 (rollout 0, step 1) and 0 (rollout 2,
    # step 2), mean 0.5; state 2 is visited once.
    expected = [[2 / 3 + 0.375, 2 / 3 + 0.5, 0.0],
                [-1 / 3 - 0.125, -1 / 3 + 0.0, 0.0],
                [-1 / 3 - 0.125, -1 / 3 - 0.125, -1 / 3 - 0.5],
                [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(out.advantages, expected, atol=1e-6)
    reference = gigpo_ref.gigpo(step_rewards, anchors, group_ids, mask, gamma=0.5, std="none")
    np.testing.assert_allclose(out.advantages, reference, atol=1e-6)
    # The exhibit: grouping by step index puts rollout 1's step 1 (state 2) against the
    # steps 1 of the other rollouts (states 1 and 0); its step term would be -1/3, not 0.
    by_index = gigpo_ref.gigpo(step_rewards, np.broadcast_to(np.arange(3), (4, 3)), group_ids,
                               mask, gamma=0.5, std="none")
    np.testing.assert_allclose(by_index[1, 1], -1 / 3 - 1 / 3, atol=1e-6)
    assert abs(by_index[1, 1] - expected[1][1]) > 0.3


def _per_turn_index(turn_rewards):
    """MT-GRPO-style per-turn-index credit: each turn's reward centred by the group mean at
    that turn index (over the rollouts that reached it), summed from the turn onwards."""
    longest = max(len(r) for r in turn_rewards)
    means = [np.mean([r[k] for r in turn_rewards if len(r) > k]) for k in range(longest)]
    return [[sum(r[j] - means[j] for j in range(t, len(r))) for t in range(len(r))]
            for r in turn_rewards]


def test_verl_issue_7244_per_turn_index_normalisation_biases_the_choice_to_take_another_turn():
    """The RFC found that normalising per-turn rewards per turn index and summing them
    subtracts a baseline whose number of terms is set by the rollout's own stopping turn:
    an action-dependent baseline, biased whenever the policy decides when to stop (a
    hidden penalty of the accumulated intermediate-reward group mean on every "take another
    turn"). stepcredit has no per-turn-index estimator; its estimators group by trajectory
    (GRPO, Dr. GRPO, RLOO) or by state (GiGPO), and on a task where stopping and continuing
    earn the same return they give the decision an exactly zero expected gradient, while
    the per-turn-index construction does not."""
    # At turn 0 the policy stops (S: one turn, reward 1) or takes another turn (C: rewards
    # 0.5 then 0.5). Both return 1, so the true policy gradient is 0. P(S) = p = sigmoid(theta).
    turns = {"S": [1.0], "C": [0.5, 0.5]}
    p = 0.3
    probability, score = {"S": p, "C": 1 - p}, {"S": 1 - p, "C": -p}  # d log pi / d theta

    def expected_gradient(turn_zero_advantages):
        total = 0.0
        for first in "SC":
            for second in "SC":
                a = turn_zero_advantages((first, second))
                total += probability[first] * probability[second] * (
                    a[0] * score[first] + a[1] * score[second])
        return total

    def per_turn(pair):
        return [advantages[0] for advantages in _per_turn_index([turns[c] for c in pair])]

    # The exhibit: in a mixed group the continuing rollout's turn-0 credit is lower by the
    # group mean of the extra turn's reward (0.5), although both returns are 1.
    stop, cont = per_turn(("S", "C"))
    np.testing.assert_allclose(cont - stop, -0.5, atol=1e-12)
    np.testing.assert_allclose(expected_gradient(per_turn), 2 * p * (1 - p) * 0.25, atol=1e-12)

    def stepcredit(name, config=None):
        # The pair, padded to the museum's [4, 3] shape by two empty rows of another group.
        def advantages(pair):
            rewards = _f32([turns[c] + [NAN] * (3 - len(turns[c])) for c in pair]
                           + [[NAN] * 3] * 2)
            mask = ~np.isnan(rewards)
            inputs = CreditInputs(
                mask=mask, step_rewards=rewards, group_ids=np.array([0, 0, 1, 1], np.int32),
                scores=_f32([sum(turns[c]) for c in pair] + [0.0, 0.0]),
                anchors=np.array([[0, 1 if c == "C" else -1, -1] for c in pair] + [[-1] * 3] * 2,
                                 np.int32))
            out = np.asarray(adv.apply(name, inputs, config).advantages)
            return out[:2] if out.ndim == 1 else out[:2, 0]
        return advantages

    for name, config in (("grpo", None), ("drgrpo", None), ("rloo", None),
                         ("gigpo", {"gamma": 1.0})):
        assert abs(expected_gradient(stepcredit(name, config))) < 1e-7, name
