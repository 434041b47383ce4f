"""stepcredit.compat.verl against verl 0.9 itself: its functions, its registry, its trainer's call."""

import subprocess
import sys

import numpy as np
import pytest

from stepcredit.advantages import normalize, registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat import agent_r1
from stepcredit.compat import verl as compat
from tests.compat.batches import as_input, as_output, close, torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos",
                                 reason="verl is installed by the README's test command")
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402

LENGTH = 12


def multi_turn_rows(seed=0):
    """verl rows of whole conversations: 1 to 3 turns separated by observation spans (mask 0).

    Groups of 4 and 3 responses and a singleton; the reward on the last turn's last token, and
    on some rows another on an observation token (verl sums all tokens).
    """
    rng = np.random.default_rng(seed)
    uids = ["a"] * 4 + ["b"] * 3 + ["solo"]
    mask = np.zeros((len(uids), LENGTH), np.float32)
    rewards = np.zeros_like(mask)
    for row in range(len(uids)):
        position = 0
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(1, 3))
            mask[row, position:position + length] = 1
            position += length + int(rng.integers(1, 3))  # an observation span after each turn
            if position >= LENGTH - 1:
                break
        last = np.flatnonzero(mask[row])[-1]
        rewards[row, last] = rng.integers(0, 3) * 0.5
        if rng.random() < 0.4 and (mask[row] == 0).any():
            rewards[row, np.flatnonzero(mask[row] == 0)[0]] += 0.25
    values = rng.normal(size=mask.shape).astype(np.float32)
    entropys = rng.random(mask.shape).astype(np.float32)
    return dict(rewards=rewards, mask=mask, values=values, entropys=entropys,
                index=np.asarray(uids, dtype=object))


def theirs(name, d, **extra):
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    return core_algos.get_adv_estimator_fn(name)(token_level_rewards=t(d["rewards"]),
                                                 response_mask=t(d["mask"]), **extra)


TRAINER_CALL = ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
                "reinforce_plus_plus_baseline"]


@pytest.mark.parametrize("name", TRAINER_CALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verl_functions_equal_verl_under_its_trainer_call(kind, name, seed):
    """verl's trainer passes token_level_rewards, response_mask, config and index."""
    d = multi_turn_rows(seed)
    config = AlgoConfig(gamma=0.9)
    expected = [x.numpy() for x in theirs(name, d, config=config, index=d["index"])]
    ours_fn = getattr(compat, core_algos.get_adv_estimator_fn(name).__name__)
    ours = ours_fn(token_level_rewards=as_input(kind, d["rewards"]), response_mask=as_input(kind, d["mask"]),
                   config=config, index=d["index"])
    close(as_output(kind, ours[0]), expected[0])
    close(as_output(kind, ours[1]), expected[1])


def test_gae_equals_verl_on_the_mask(kind):
    d = multi_turn_rows(3)
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    expected = core_algos.compute_gae_advantage_return(t(d["rewards"]), t(d["values"]), t(d["mask"]),
                                                       gamma=0.95, lam=0.9)
    ours = compat.compute_gae_advantage_return(as_input(kind, d["rewards"]), as_input(kind, d["values"]),
                                               as_input(kind, d["mask"]), gamma=0.95, lam=0.9)
    valid = d["mask"] > 0  # verl leaves carried values off the mask, which its losses ignore
    for mine, reference in zip(ours, expected):
        close(as_output(kind, mine)[valid], reference.numpy()[valid])


def test_bfloat16_inputs_give_bfloat16_outputs_near_verl_float32():
    d = multi_turn_rows(4)
    expected = theirs("grpo", d, index=d["index"])[0].numpy()
    bf16 = lambda x: torch.from_numpy(np.array(x)).to(torch.bfloat16)  # noqa: E731
    ours, _ = compat.compute_grpo_outcome_advantage(bf16(d["rewards"]), bf16(d["mask"]), d["index"])
    assert ours.dtype == torch.bfloat16
    np.testing.assert_allclose(ours.float().numpy(), expected, atol=2e-2)


def test_reinforce_pp_follows_the_installed_verl_rule():
    """verl 0.9 carries the return across observation spans; older verl reset it."""
    assert compat.observation_span_rule() == "carry"
    d = multi_turn_rows(5)
    config = {"gamma": 0.9}
    carried = compat.compute_reinforce_plus_plus_outcome_advantage(d["rewards"], d["mask"], config)[1]
    reset = compat.compute_reinforce_plus_plus_outcome_advantage(d["rewards"], d["mask"], config,
                                                                 observation_spans="reset")[1]
    assert np.abs(carried - reset).max() > 0.1  # multi-turn rows: the two rules differ
    with pytest.raises(ValueError, match="config has no gamma"):
        compat.compute_reinforce_plus_plus_outcome_advantage(d["rewards"], d["mask"])
    with pytest.raises(ValueError, match="observation_spans='foo'; it must be None, 'carry'"):
        compat.compute_reinforce_plus_plus_outcome_advantage(d["rewards"], d["mask"], config,
                                                             observation_spans="foo")


@pytest.mark.parametrize("version,rule", [("0.9.1", "carry"), ("0.9rc1", "carry"), ("0.10.dev0", "carry"),
                                          ("1", "carry"), ("0.8.5.post1", "reset")])
def test_observation_span_rule_reads_pre_and_post_releases(monkeypatch, version, rule):
    monkeypatch.setattr(compat.importlib.metadata, "version", lambda name: version)
    assert compat.observation_span_rule() == rule


# ---------------------------------------------------------------- stepcredit estimators in verl


def test_plugin_registers_on_a_fresh_verl_import():
    code = ("import verl.trainer.ppo.core_algos as c; f = c.get_adv_estimator_fn('stepcredit_gigpo'); "
            "print(f.__module__, f.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["stepcredit.compat._turns", "stepcredit_gigpo"]


def test_registry_holds_the_step_level_estimators():
    names = compat.register()
    for name in ("step_gae", "gigpo", "empg", "grpo+empg", "istar", "rloo+istar", "turn_ppo", "mt_grpo",
                 "prime"):
        assert "stepcredit_" + name in names
        assert core_algos.get_adv_estimator_fn("stepcredit_" + name).__name__ == "stepcredit_" + name
    assert "stepcredit_grpo" not in names  # trajectory-level: verl's own grpo covers it


def _turns(mask_row):
    """Turn spans from a Python loop: [start, stop) of each run of 1s, and each span's owner range."""
    starts = [n for n in range(len(mask_row)) if mask_row[n] and (n == 0 or not mask_row[n - 1])]
    spans = []
    for k, start in enumerate(starts):
        stop = start
        while stop < len(mask_row) and mask_row[stop]:
            stop += 1
        owner_stop = starts[k + 1] if k + 1 < len(starts) else len(mask_row)
        spans.append((start, stop, 0 if k == 0 else start, owner_stop))
    return spans


def test_step_gae_on_turns_equals_step_rows(kind):
    """A conversation's turns as step rows (Agent-R1's layout) give the same step GAE."""
    d = multi_turn_rows(6)
    config = AlgoConfig(gamma=0.95, lam=0.9)
    ours, returns = core_algos.get_adv_estimator_fn("stepcredit_step_gae")(
        token_level_rewards=as_input(kind, d["rewards"]), response_mask=as_input(kind, d["mask"]),
        index=d["index"], config=config, values=as_input(kind, d["values"]))
    rows, traj, step, spans_of = [], [], [], []
    for b in range(len(d["mask"])):
        for k, (start, stop, owner_start, owner_stop) in enumerate(_turns(d["mask"][b])):
            reward = np.zeros(LENGTH, np.float32)
            reward[0] = d["rewards"][b, owner_start:owner_stop].sum()
            value = np.zeros(LENGTH, np.float32)
            value[0] = d["values"][b, start]
            rows.append((reward, value))
            traj.append(b)
            step.append(k)
            spans_of.append((b, start, stop))
    step_mask = np.zeros((len(rows), LENGTH), np.float32)
    step_mask[:, 0] = 1
    expected, expected_returns = agent_r1.compute_gae_advantage_return(
        np.stack([r for r, _ in rows]), np.stack([v for _, v in rows]), step_mask,
        np.asarray(traj), np.asarray(step), 0.95, 0.9)
    for i, (b, start, stop) in enumerate(spans_of):
        close(as_output(kind, ours)[b, start:stop], np.full(stop - start, expected[i, 0]))
        close(as_output(kind, returns)[b, start:stop], np.full(stop - start, expected_returns[i, 0]))
    assert (as_output(kind, ours)[d["mask"] == 0] == 0).all()


def test_gigpo_and_empg_on_turns_read_their_batch_keys():
    d = multi_turn_rows(7)
    spans = [_turns(row) for row in d["mask"]]
    rng = np.random.default_rng(7)
    anchor_obs = np.empty(len(spans), dtype=object)
    anchor_obs[:] = [[f"room {rng.integers(0, 2)}" for _ in row] for row in spans]
    config = AlgoConfig(gamma=0.9)
    ours, _ = core_algos.get_adv_estimator_fn("stepcredit_gigpo")(
        token_level_rewards=torch.from_numpy(d["rewards"]), response_mask=torch.from_numpy(d["mask"]),
        index=d["index"], config=config, anchor_obs=anchor_obs)
    turns = max(len(row) for row in spans)
    step_rewards = np.zeros((len(spans), turns), np.float32)
    anchors = np.full((len(spans), turns), -1, np.int32)
    valid = np.zeros((len(spans), turns), bool)
    names = {}
    for b, row in enumerate(spans):
        for k, (_, _, owner_start, owner_stop) in enumerate(row):
            step_rewards[b, k] = d["rewards"][b, owner_start:owner_stop].sum()
            anchors[b, k] = names.setdefault(anchor_obs[b][k], len(names))
            valid[b, k] = True
    groups = np.unique(d["index"], return_inverse=True)[1]
    expected = registry.apply("gigpo", CreditInputs(step_rewards=step_rewards, anchors=anchors,
                                                    group_ids=groups, mask=valid), {"gamma": 0.9}).advantages
    for b, row in enumerate(spans):
        for k, (start, stop, _, _) in enumerate(row):
            close(ours.numpy()[b, start:stop], np.full(stop - start, float(expected[b, k])))
    with pytest.raises(ValueError, match="reads entropy, from entropys"):
        core_algos.get_adv_estimator_fn("stepcredit_empg")(
            token_level_rewards=torch.from_numpy(d["rewards"]), response_mask=torch.from_numpy(d["mask"]),
            index=d["index"], config=config)
    if len({len(row) for row in anchor_obs}) == 1:
        raise AssertionError("the batch should mix turn counts")
    square = np.array([["a", "b"], ["a", "c"]], dtype=object)  # equal turn counts: verl's 2-D array
    two = dict(token_level_rewards=torch.zeros(2, 6), response_mask=torch.tensor([[1, 0, 1, 0, 0, 0]] * 2),
               index=np.array(["u", "u"], dtype=object), config=config)
    core_algos.get_adv_estimator_fn("stepcredit_gigpo")(anchor_obs=square, **two)
    short = anchor_obs.copy()
    short[0] = short[0][:-1] if len(short[0]) > 1 else []
    with pytest.raises(ValueError, match="anchor_obs row 0 holds"):
        core_algos.get_adv_estimator_fn("stepcredit_gigpo")(
            token_level_rewards=torch.from_numpy(d["rewards"]), response_mask=torch.from_numpy(d["mask"]),
            index=d["index"], config=config, anchor_obs=short)


def test_compute_advantage_feeds_a_data_proto():
    d = multi_turn_rows(8)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.from_numpy(d["rewards"]),
                 "response_mask": torch.from_numpy(d["mask"]), "values": torch.from_numpy(d["values"]),
                 "entropys": torch.from_numpy(d["entropys"])},
        non_tensors={"uid": d["index"]})
    config = AlgoConfig(gamma=1.0, lam=1.0)
    out = compat.compute_advantage(data, "stepcredit_grpo+empg", config=config)
    assert out is data and data.batch["advantages"].shape == (len(d["index"]), LENGTH)
    direct, _ = compat.turn_estimator("grpo+empg")(
        token_level_rewards=d["rewards"], response_mask=d["mask"], index=d["index"], config=config,
        entropys=d["entropys"])
    close(data.batch["advantages"].numpy(), direct)
    compat.compute_advantage(data, "stepcredit_step_gae", config=config)
    direct = compat.turn_estimator("step_gae")(
        token_level_rewards=d["rewards"], response_mask=d["mask"], config=config, values=d["values"])
    close(data.batch["advantages"].numpy(), direct[0])
    close(data.batch["returns"].numpy(), direct[1])


def test_turn_estimator_refuses_what_verl_rows_cannot_feed():
    with pytest.raises(ValueError, match="'vineppo' reads"):
        compat.turn_estimator("vineppo")
    with pytest.raises(ValueError, match="no hyperparameter 'not_a_knob'"):
        compat.turn_estimator("gigpo", {"not_a_knob": 1})


def test_prime_reads_rm_scores_as_its_token_rewards():
    d = multi_turn_rows(9)
    rm_scores = (np.random.default_rng(9).normal(size=d["mask"].shape) * 0.1).astype(np.float32)
    ours, _ = core_algos.get_adv_estimator_fn("stepcredit_prime")(
        token_level_rewards=torch.from_numpy(d["rewards"]), response_mask=torch.from_numpy(d["mask"]),
        index=d["index"], config=AlgoConfig(), rm_scores=torch.from_numpy(rm_scores))
    mask = d["mask"] > 0
    groups = np.unique(d["index"], return_inverse=True)[1]
    expected = registry.apply("prime", CreditInputs(prime_token_rewards=rm_scores, scores=d["rewards"].sum(1),
                                                    action_mask=mask, group_ids=groups)).advantages
    close(ours.numpy(), np.asarray(normalize.masked_whiten(expected, mask)))
