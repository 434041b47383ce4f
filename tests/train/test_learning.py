"""Training learns: a short GRPO run from a fixed seed raises test success from 0.

The other trainer tests check plumbing (shapes, metrics, checkpoints); this one fails
when a change breaks learning itself (rollouts, credit, the PPO update, evaluation).

Setting: HotpotQA, difficulty 0, a step limit of 1 and numbered choices. An episode is
one pick among the first step's admissible actions: search either entity of the
question (always a failure: the limit ends the episode before the page can be used) or
finish with either entity, yes or no. A 10-step warm start on the expert's
demonstrations (cut to one step by the limit) teaches the expert's first action, a
search, so the policy that RL starts from wins 0.00 of the 128 test tasks (greedy); any
success after it is RL's. What RL can learn in one step is to answer at once: with an
entity on the comparison questions (about half of them won) and "no" on whether two
people are citizens of the same country (most pairs are not); bridge questions (about
half the tasks) need two searches and stay lost, so about 0.3 is the ceiling.

Flags: `LEARNING` below (d_model 32, one layer, 16 tasks x 8 rollouts an iteration, 15
iterations of 4 epochs over the batch as one minibatch, learning rate 2e-3, greedy
evaluation on 128 test tasks before RL and after every 5th iteration).

Threshold: the mean test success of the three evaluations after RL (iterations 4, 9
and 14) is at least 0.12 and 0.10 above the start, and the mean rollout success
(sampled) of the last 5 iterations is at least 0.06 above the first iteration's.
Measured, test success at iterations -1, 4, 9, 14 (mean after RL); rollout success,
first iteration -> mean of the last 5:

  seed 0 (the test's): 0.00, 0.16, 0.32, 0.27 (0.25); rollout 0.01 -> 0.26
  seed 1: 0.00, 0.21, 0.12, 0.27 (0.20); rollout 0.00 -> 0.26
  seed 2: 0.00, 0.19, 0.19, 0.18 (0.19); rollout 0.01 -> 0.16
  seed 3: 0.00, 0.22, 0.21, 0.22 (0.22); rollout 0.02 -> 0.14

Learning broken, seed 0: `--learning-rate 0` or `1e-9` (no warm start either) keeps
test success at 0.01 and rollout success at 0.08 -> 0.08; `--lr-warmup 1000000` (the warm
start, then RL at a rate of about 0) keeps 0.00 and 0.01 -> 0.00. Step GAE with these
flags does not learn within the 15 iterations (0.00, 0.00, 0.07, 0.00).

Run: `.venv/bin/python -m pytest tests/train/test_learning.py -q` (35 to 65 s with the
compilation cache warm, 60 to 110 s cold, on the shared 2-core CPU; about 30 s of CPU
time warm).
"""

import statistics

from stepcredit.cli import main
from stepcredit.train.metrics import read_metrics

LEARNING = ["--env", "hotpotqa", "--difficulty", "0", "--estimator", "grpo", "--seed", "0",
            "--action-format", "choice", "--max-steps", "1", "--max-prompt-tokens", "128",
            "--d-model", "32", "--num-layers", "1", "--tasks-per-iteration", "16",
            "--group-size", "8", "--iterations", "15", "--minibatch-rows", "128", "--epochs", "4",
            "--learning-rate", "2e-3", "--warm-start-steps", "10", "--eval-every", "5",
            "--eval-tasks", "128", "--checkpoint-every", "100"]

TEST_SUCCESS_AFTER_RL = 0.12
TEST_SUCCESS_GAIN = 0.10
ROLLOUT_SUCCESS_GAIN = 0.06


def test_grpo_raises_success_from_a_warm_start_that_wins_nothing(tmp_path):
    assert main(["train", *LEARNING, "--logdir", str(tmp_path)]) == 0
    rows = read_metrics(str(tmp_path))
    test = {r["iteration"]: r["eval/success"] for r in rows if "eval/success" in r}
    rollout = [r["rollout/success"] for r in rows if "rollout/success" in r]
    curves = f"test success by iteration {test}, rollout success {rollout}"
    assert sorted(test) == [-1, 4, 9, 14] and len(rollout) == 15, curves
    # The warm start leaves a policy that searches: no test task is won before RL.
    assert test[-1] <= 0.02, curves
    after = statistics.mean(test[i] for i in (4, 9, 14))
    assert after >= TEST_SUCCESS_AFTER_RL and after >= test[-1] + TEST_SUCCESS_GAIN, curves
    assert statistics.mean(rollout[-5:]) >= rollout[0] + ROLLOUT_SUCCESS_GAIN, curves
