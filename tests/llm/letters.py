"""A toy environment whose reward any answer earns in part: a random chat model's episodes differ.

Each step's reward is the share of the answer's characters that are lowercase
letters, less a third (an episode whose rewards sum above 0 is a success for
iStar's PRM); an episode is cut by its step limit (a critic bootstraps it) and
is won when at least half of its last answer is lowercase letters. With tiny
random checkpoints on the simulators every answer is an invalid action, so a
group's rewards are all equal and critic-free advantages are 0; here they
differ, so a training iteration must move the policy (and iStar's PRM finds
won and lost episodes to compare). Registered by the tests that use it, for
their duration (`stepcredit.envs.register`).
"""

from stepcredit.envs.base import Observation, StepResult, step_info

NAME = "letters"


class Letters:
    name = NAME
    splits = ("train", "test")
    num_tasks = 4

    def __init__(self, split: str = "train", difficulty: int = 0, seed: int = 0, max_steps: int = 3):
        self.max_steps = max_steps
        self.t, self.task = 0, 0

    def _observation(self) -> Observation:
        return Observation(text=f"step {self.t}: write", admissible_actions=None,
                           anchor=(self.task, self.t), task=f"task {self.task}")

    def reset(self, task) -> Observation:
        self.t, self.task = 0, int(task)
        return self._observation()

    def step(self, action: str) -> StepResult:
        self.t += 1
        share = sum(c.islower() for c in action) / max(len(action), 1)
        cut = self.t >= self.max_steps
        won = cut and share >= 0.5
        return StepResult(self._observation(), share - 1 / 3, False, cut,
                          step_info(valid=True, won=won, score=float(won)))

    def close(self) -> None:
        pass

