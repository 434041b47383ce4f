"""`stepcredit demo`: token-level versus step-level GAE on toy agent trajectories.

Builds a few multi-step trajectories whose actions span several tokens, with a
sparse final reward, an invalid-action penalty and a toy critic, then prints
per step how the two estimators assign credit.
"""

from __future__ import annotations

import argparse

import numpy as np

HELP = "compare token-level and step-level GAE on toy multi-step trajectories"

# Taken off an invalid step's reward, as in the GiGPO, iStar and StepPO scripts.
_INVALID_ACTION_PENALTY = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gamma", type=float, default=1.0, help="discount (StepPO: 1)")
    parser.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    parser.add_argument("--seed", type=int, default=0, help="seed of the toy trajectories")


def toy_trajectories(seed: int):
    """Three episodes of a search-like task: 4, 3 and 5 steps of 2-5 action tokens.

    The critic's value rises within a step as the action unfolds (a token-level
    critic sees partial actions), which is exactly what step-level GAE ignores.
    """
    from stepcredit.batch import StepRecord, Trajectory

    rng = np.random.default_rng(seed)
    outcomes = [(4, 1.0, {1}), (3, 0.0, set()), (5, 1.0, {2})]  # (steps, final reward, invalid steps)
    trajectories, token_values = [], []
    for group_id, (num_steps, final_reward, invalid) in enumerate(outcomes):
        steps, values = [], []
        for t in range(num_steps):
            n_obs, n_act = int(rng.integers(2, 4)), int(rng.integers(2, 6))
            progress = (t + 1) / num_steps
            step_value = round(0.3 + 0.5 * final_reward * progress, 3)
            reward = (final_reward if t == num_steps - 1 else 0.0) - (
                _INVALID_ACTION_PENALTY if t in invalid else 0.0)
            steps.append(StepRecord(
                observation_ids=rng.integers(10, 100, n_obs).tolist(),
                action_ids=rng.integers(100, 200, n_act).tolist(),
                action_logp=(-rng.uniform(0.1, 2.0, n_act)).tolist(),
                action_entropy=rng.uniform(0.2, 2.0, n_act).tolist(),
                reward=reward, done=t == num_steps - 1, value=step_value))
            values += [np.nan] * n_obs + [step_value + 0.05 * k for k in range(n_act)]
        trajectories.append(Trajectory(steps=steps, group_id=group_id))
        token_values.append(values)
    return trajectories, token_values


def run(args: argparse.Namespace) -> int:
    from stepcredit.advantages import step_gae, token_gae
    from stepcredit.batch import collate

    trajectories, token_values = toy_trajectories(args.seed)
    steps, tokens, _ = collate(trajectories)
    values = np.full(tokens.tokens.shape, np.nan, np.float32)
    for b, row in enumerate(token_values):
        values[b, :len(row)] = row
    # The environment's step reward sits on the step's last action token.
    token_rewards = np.zeros(tokens.tokens.shape, np.float32)
    for b in range(len(trajectories)):
        for t in range(int(steps.mask[b].sum())):
            last = np.nonzero(tokens.step_index[b] == t)[0][-1]
            token_rewards[b, last] = steps.reward[b, t]

    by_step = step_gae(steps.reward, steps.value, steps.mask, gamma=args.gamma, lam=args.lam)
    by_token = token_gae(token_rewards, values, tokens.action_mask, gamma=args.gamma, lam=args.lam)
    step_adv, token_adv = np.asarray(by_step.advantages), np.asarray(by_token.advantages)

    print(f"token-level vs step-level GAE (gamma={args.gamma}, lam={args.lam}); "
          f"reward on the last step, -{_INVALID_ACTION_PENALTY} for an invalid action\n")
    header = (f"{'traj':>4} {'step':>4} {'tokens':>6} {'reward':>7} {'V(s_t)':>7} "
              f"{'step A_t':>9} {'token A first..last':>22} {'token A mean':>12}")
    print(header)
    print("-" * len(header))
    for b in range(len(trajectories)):
        for t in range(int(steps.mask[b].sum())):
            positions = tokens.step_index[b] == t
            first, last = token_adv[b, positions][[0, -1]]
            print(f"{b:>4} {t:>4} {int(positions.sum()):>6} {steps.reward[b, t]:>7.2f} "
                  f"{steps.value[b, t]:>7.3f} {step_adv[b, t]:>9.4f} "
                  f"{first:>10.4f}..{last:<10.4f} {token_adv[b, positions].mean():>12.4f}")
        print()
    print("Step-level GAE gives every token of a step the same credit A_t (StepPO, "
          "arXiv 2604.18401);\ntoken-level GAE spreads it over the tokens, discounting "
          "with gamma*lam at every token.")
    return 0
