"""EnvPool: groups, skipping finished episodes, step limits, failures, threads,
closing; and the registry."""

from __future__ import annotations

import time

import pytest

from stepcredit.envs import EnvPool, make, names, register
from stepcredit.envs.alfworld import NOTHING_HAPPENS, AlfWorldEnv
from stepcredit.envs.base import Observation, StepResult, step_info


class _Scripted:
    """A toy environment: episode length `length`; raises on step `fail_at`,
    sleeps `delay` seconds per call, and records whether it was closed."""

    name = "scripted"

    def __init__(self, length=3, fail_at=None, delay=0.0, fail_close=False, max_steps=10):
        self.length, self.fail_at, self.delay, self.fail_close = length, fail_at, delay, fail_close
        self.max_steps = max_steps
        self.closed = False
        self.t = 0

    def reset(self, task):
        time.sleep(self.delay)
        self.t, self.task = 0, task
        return Observation(f"task {task} t 0", ("go",), (task, 0), str(task))

    def step(self, action):
        time.sleep(self.delay)
        self.t += 1
        if self.t == self.fail_at:
            raise ConnectionError("server went away")
        done = self.t >= self.length
        obs = Observation(f"task {self.task} t {self.t}", ("go",), (self.task, self.t),
                          str(self.task))
        return StepResult(obs, float(done), done, False, step_info(valid=True, won=done))

    def close(self):
        self.closed = True
        if self.fail_close:
            raise OSError("close failed")


def test_group_members_start_from_the_same_task():
    with EnvPool.from_factory(lambda: AlfWorldEnv(split="seen"), 6) as pool:
        observations = pool.reset_groups([3, 8], group_size=3)
        assert pool.group_ids == (0, 0, 0, 1, 1, 1)
        assert len({(o.text, o.task, o.anchor) for o in observations[:3]}) == 1
        assert len({(o.text, o.task, o.anchor) for o in observations[3:]}) == 1
        assert observations[0].task != observations[3].task or \
            observations[0].text != observations[3].text
        with pytest.raises(ValueError, match="group_size 4"):
            pool.reset_groups([1, 2], group_size=4)


def test_step_skips_finished_episodes():
    envs = [_Scripted(length=1), _Scripted(length=3)]
    with EnvPool(envs) as pool:
        pool.reset([0, 1])
        first = pool.step(["go", "go"])
        assert first[0].done and not first[1].done
        assert pool.running == (False, True)
        second = pool.step([None, "go"])
        assert second[0] is None and second[1].observation.text == "task 1 t 2"
        with pytest.raises(TypeError, match=r"actions\[1\]"):
            pool.step([None, None])


def test_invalid_action_does_not_end_the_episode():
    with EnvPool([AlfWorldEnv(), AlfWorldEnv()]) as pool:
        pool.reset([0, 1])
        results = pool.step(["juggle the fridge", "look"])
        assert results[0].observation.text == NOTHING_HAPPENS
        assert results[0].info["valid"] is False and results[1].info["valid"] is True
        assert pool.running == (True, True)


def test_step_limit_truncates():
    with EnvPool([_Scripted(length=5), _Scripted(length=5, max_steps=1)], max_steps=2) as pool:
        pool.reset([0, 1])
        first = pool.step(["go", "go"])
        assert not first[0].truncated and first[1].truncated and not first[1].done
        second = pool.step(["go", None])
        assert second[0].truncated and not second[0].done and second[1] is None
        assert pool.running == (False, False)
    with EnvPool([AlfWorldEnv(max_steps=2)]) as pool:
        pool.reset([0])
        pool.step(["look"])
        assert pool.step(["look"])[0].truncated


@pytest.mark.parametrize("num_threads", [0, 3])
def test_an_exception_ends_only_that_episode(num_threads):
    envs = [_Scripted(length=4), _Scripted(length=4, fail_at=2), _Scripted(length=4)]
    with EnvPool(envs, num_threads=num_threads) as pool:
        pool.reset([0, 1, 2])
        pool.step(["go"] * 3)
        results = pool.step(["go"] * 3)
        broken = results[1]
        assert broken.truncated and not broken.done and broken.info["aborted"]
        assert broken.info["error"] == "ConnectionError: server went away"
        assert broken.observation.text == "task 1 t 1"  # the last good observation
        assert pool.running == (True, False, True)
        results = pool.step(["go", None, "go"])
        assert results[1] is None and results[0].observation.text == "task 0 t 3"


def test_threads_overlap_waiting_environments():
    envs = [_Scripted(delay=0.05) for _ in range(4)]
    with EnvPool(envs, num_threads=4) as pool:
        start = time.perf_counter()
        pool.reset(range(4))
        pool.step(["go"] * 4)
        elapsed = time.perf_counter() - start
        assert [o.text for o in pool.observations] == [f"task {i} t 1" for i in range(4)]
    assert elapsed < 0.3  # sequential calls would take 0.4 s


def test_close_closes_every_environment():
    envs = [_Scripted(), _Scripted(fail_close=True), _Scripted()]
    pool = EnvPool(envs)
    pool.reset([0, 1, 2])
    with pytest.raises(OSError, match="close failed"):
        pool.close()
    assert all(env.closed for env in envs)
    pool.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        pool.step(["go"] * 3)
    envs = [_Scripted(), _Scripted()]
    with pytest.raises(ZeroDivisionError):
        with EnvPool(envs):
            1 / 0
    assert all(env.closed for env in envs)


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="envs is empty"):
        EnvPool([])
    with pytest.raises(ValueError, match="got 1 tasks for 2"):
        EnvPool([_Scripted(), _Scripted()]).reset([0])


def test_registry():
    assert {"alfworld", "hotpotqa", "webshop"} <= set(names())
    env = make("webshop", split="test", difficulty=0)
    assert env.name == "webshop" and env.config.split == "test" and env.max_steps == 15
    assert make("alfworld").max_steps == 50 and make("hotpotqa").max_steps == 8
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        make("chess")
    with pytest.raises(ValueError, match="already registered"):
        register("webshop", AlfWorldEnv)


def test_closing_a_pool_closes_its_environments_in_parallel():
    import threading
    import time

    from stepcredit.envs.pool import EnvPool

    class SlowToClose:
        max_steps = 3

        def __init__(self):
            self.closed = threading.Event()

        def close(self):
            time.sleep(0.3)  # an HTTP instance whose server stopped answering
            self.closed.set()

    envs = [SlowToClose() for _ in range(6)]
    pool = EnvPool(envs)
    started = time.monotonic()
    pool.close()
    assert all(env.closed.is_set() for env in envs)
    assert time.monotonic() - started < 1.2  # one after another: 1.8 s
