"""stepcredit.compat.verl against plain loops written from verl's conventions, numpy and torch."""

import numpy as np
import pytest

from stepcredit.compat import verl
from tests.reference import verl as reference

torch = pytest.importorskip("torch", reason="the torch tests need `pip install -e '.[torch]'`")

LENGTH = 6


def step_rows(seed=0):
    """Step rows of 4 groups (one a single one-step trajectory), shuffled; discrete scores."""
    rng = np.random.default_rng(seed)
    index, traj, step, anchors = [], [], [], []
    for g, trajectories in enumerate([3, 2, 1, 4]):
        for j in range(trajectories):
            length = 1 if g == 2 else int(rng.integers(1, 4))
            for t in range(length):
                index.append(f"uid-{g}")
                traj.append(f"traj-{g}-{j}")
                step.append(t)
                anchors.append(f"room {int(rng.integers(0, 3))}" if t else "start")
    size = len(index)
    valid_length = rng.integers(1, LENGTH + 1, size)
    mask = (np.arange(LENGTH)[None] < valid_length[:, None]).astype(np.float32)
    rewards = np.zeros((size, LENGTH), np.float32)
    rewards[np.arange(size), valid_length - 1] = rng.integers(0, 3, size) * 0.5
    values = rng.normal(size=(size, LENGTH)).astype(np.float32)
    entropy = rng.random((size, LENGTH)).astype(np.float32)
    order = rng.permutation(size)
    obj = lambda x: np.asarray(x, dtype=object)[order]  # noqa: E731
    return dict(rewards=rewards[order], mask=mask[order], values=values[order],
                entropy=entropy[order], index=obj(index), traj=obj(traj),
                step=np.asarray(step)[order], anchors=obj(anchors))


@pytest.fixture(params=["numpy", "torch"])
def kind(request):
    return request.param


def _in(kind, x):
    return torch.from_numpy(np.array(x)) if kind == "torch" else x


def _out(kind, x):
    if kind == "torch":
        assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
        return x.numpy()
    assert isinstance(x, np.ndarray) and x.dtype == np.float32
    return x


def close(actual, expected, atol=1e-5):
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=atol * scale)


def test_gae(kind):
    d = step_rows(1)
    advantages, returns = verl.compute_gae_advantage_return(
        _in(kind, d["rewards"]), _in(kind, d["values"]), _in(kind, d["mask"]), gamma=0.9, lam=0.8)
    expected = reference.gae(d["rewards"], d["values"], d["mask"], 0.9, 0.8)
    close(_out(kind, advantages), expected[0])
    close(_out(kind, returns), expected[1])


def test_step_gae_orders_rows_by_trajectory_and_step(kind):
    d = step_rows(2)
    advantages, returns = verl.compute_step_gae_advantage_return(
        _in(kind, d["rewards"]), _in(kind, d["values"]), _in(kind, d["mask"]), d["traj"], d["step"],
        gamma=0.95, lam=0.9)
    expected = reference.step_gae(d["rewards"], d["values"], d["mask"], d["traj"], d["step"], 0.95, 0.9)
    close(_out(kind, advantages), expected[0], atol=1e-4)
    close(_out(kind, returns), expected[1])
    returns = verl.compute_step_discounted_returns(_in(kind, d["rewards"]), _in(kind, d["mask"]),
                                                   d["traj"], d["step"], gamma=0.5)
    close(_out(kind, returns), reference.step_discounted_returns(d["rewards"], d["mask"], d["traj"],
                                                                  d["step"], 0.5))


@pytest.mark.parametrize("multi_step", [False, True])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_unbiased_std_eps_and_raw_singleton(kind, multi_step, norm):
    d = step_rows(3)
    traj = d["traj"] if multi_step else None
    advantages, returns = verl.compute_grpo_outcome_advantage(
        _in(kind, d["rewards"]), _in(kind, d["mask"]), d["index"], traj, epsilon=1e-6,
        norm_adv_by_std_in_grpo=norm)
    close(_out(kind, advantages), reference.grpo(d["rewards"], d["mask"], d["index"], traj, 1e-6, norm))
    assert returns is advantages
    single = np.flatnonzero(d["index"] == "uid-2")
    raw = (d["rewards"][single] * d["mask"][single]).sum() / (1 + 1e-6 if norm else 1)
    close(_out(kind, advantages)[single, 0], np.float32([raw]))


@pytest.mark.parametrize("multi_step", [False, True])
def test_rloo_and_reinforce_pp(kind, multi_step):
    d = step_rows(4)
    traj = d["traj"] if multi_step else None
    advantages, _ = verl.compute_rloo_outcome_advantage(_in(kind, d["rewards"]), _in(kind, d["mask"]),
                                                        d["index"], traj)
    close(_out(kind, advantages), reference.rloo(d["rewards"], d["mask"], d["index"], traj))
    advantages, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(
        _in(kind, d["rewards"]), _in(kind, d["mask"]), d["index"], traj)
    close(_out(kind, advantages), reference.reinforce_pp_baseline(d["rewards"], d["mask"], d["index"], traj))
    advantages, returns = verl.compute_reinforce_plus_plus_outcome_advantage(
        _in(kind, d["rewards"]), _in(kind, d["mask"]), gamma=0.9)
    expected = reference.reinforce_pp(d["rewards"], d["mask"], 0.9)
    close(_out(kind, advantages), expected[0])
    close(_out(kind, returns), expected[1])


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("cross_steps", [True, False])
def test_gigpo_per_row_episode_statistics(kind, mode, cross_steps):
    d = step_rows(5)
    # verl-agent writes the episode reward on every step row
    totals = {}
    for i, t in enumerate(d["traj"]):
        totals[t] = totals.get(t, 0.0) + (d["rewards"][i] * d["mask"][i]).sum()
    rewards = np.zeros_like(d["rewards"])
    last = d["mask"].sum(1).astype(int) - 1
    rewards[np.arange(len(rewards)), last] = [totals[t] for t in d["traj"]]
    step_rewards = reference.step_discounted_returns(d["rewards"], d["mask"], d["traj"], d["step"], 0.95)
    advantages, _ = verl.compute_gigpo_outcome_advantage(
        _in(kind, rewards), _in(kind, step_rewards.astype(np.float32)), _in(kind, d["mask"]),
        d["anchors"], d["index"], d["traj"], epsilon=1e-6, step_advantage_w=1.0, mode=mode,
        compute_mean_std_cross_steps=cross_steps)
    expected = reference.gigpo(rewards, step_rewards.astype(np.float32), d["mask"], d["anchors"],
                               d["index"], d["traj"], 1e-6, 1.0, mode, cross_steps)
    close(_out(kind, advantages), expected, atol=1e-4)


def test_empg(kind):
    d = step_rows(6)
    base, _ = verl.compute_grpo_outcome_advantage(d["rewards"], d["mask"], d["index"], d["traj"])
    advantages, _ = verl.compute_empg_advantage(_in(kind, base), _in(kind, d["entropy"]),
                                                _in(kind, d["mask"]), d["traj"], d["step"])
    filled = np.repeat(base[:, :1], LENGTH, 1)  # column 0 is always masked in
    close(_out(kind, advantages), reference.empg(filled, d["entropy"], d["mask"], d["traj"], d["step"]))


@pytest.mark.parametrize("mode, baseline", [("rloo", "first_step"), ("rloo", "all_steps"),
                                            ("grpo", "first_step")])
def test_istar(kind, mode, baseline):
    d = step_rows(8)
    totals = {}
    for i, t in enumerate(d["traj"]):
        totals[t] = totals.get(t, 0.0) + (d["rewards"][i] * d["mask"][i]).sum()
    rewards = np.zeros_like(d["rewards"])
    rewards[:, 0] = [totals[t] for t in d["traj"]]  # the episode reward on every step row
    implicit = np.random.default_rng(8).normal(size=len(rewards)).astype(np.float32) * 0.1
    advantages, _ = verl.compute_istar_advantage(
        _in(kind, rewards), _in(kind, implicit), _in(kind, d["mask"]), d["index"], d["traj"],
        d["step"], mode=mode, step_baseline=baseline)
    expected = reference.istar(rewards, implicit, d["mask"], d["index"], d["traj"], d["step"],
                               mode=mode, baseline=baseline)
    close(_out(kind, advantages), expected, atol=1e-4)


def test_step_layout_errors():
    d = step_rows(7)
    steps = d["step"].copy()
    steps[np.flatnonzero(steps == 1)[0]] = 3
    with pytest.raises(ValueError, match="must run 0, 1"):
        verl.compute_step_gae_advantage_return(d["rewards"], d["values"], d["mask"], d["traj"], steps)
    with pytest.raises(ValueError, match="response_mask"):
        verl.compute_grpo_outcome_advantage(d["rewards"], d["mask"][:, :2], d["index"])
