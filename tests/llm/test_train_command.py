"""`stepcredit train --policy qwen`: tiny random Qwen2 / Qwen3 trained by the trainer's run."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from flax import nnx  # noqa: E402

from stepcredit.envs import registry as envs  # noqa: E402
from stepcredit import advantages  # noqa: E402
from stepcredit.cli import main  # noqa: E402
from stepcredit.llm import checkpoint  # noqa: E402
from stepcredit.train.config import TrainConfig  # noqa: E402
from stepcredit.train.metrics import read_metrics  # noqa: E402
from stepcredit.train.qwen import QwenTrainer  # noqa: E402
from tests.llm import letters  # noqa: E402
from tests.llm.checkpoints import write  # noqa: E402

SMALL = ["--tasks-per-iteration", "1", "--group-size", "3", "--max-steps", "2",
         "--max-action-tokens", "6", "--history-window", "0", "--learning-rate", "1e-3",
         "--minibatch-rows", "4", "--checkpoint-every", "1"]


def _restored(logdir, iteration):
    """The learner's parameters restored from `logdir`'s newest checkpoint, which must be `iteration`'s."""
    trainer = QwenTrainer(TrainConfig.from_json((logdir / "config.json").read_text()), log=lambda _: None)
    assert trainer.restore() == iteration
    learner = trainer.learner  # the model's weights: the parameters, or the adapters merged in
    return jax.tree.map(np.array, learner._merge(learner.params, learner.frozen))


def _params(folder):
    return jax.tree.map(np.array, nnx.state(checkpoint.load(folder).model, nnx.Param))


@pytest.fixture
def toy_env():
    envs.register(letters.NAME, letters.Letters)
    yield
    envs.unregister(letters.NAME)


@pytest.mark.parametrize("family, env, estimator, extra, resume", [
    ("qwen2", "hotpotqa", "grpo", ["--kl-coef", "0.1", "--eval-every", "1", "--eval-tasks", "1"], True),
    ("qwen3", "hotpotqa", "grpo+empg", ["--step-level-ratio"], False),
    ("qwen2", letters.NAME, "step_gae", ["--step-level-ratio", "--critic-learning-rate", "1e-3"], False),
    ("qwen3", letters.NAME, "rloo+istar", ["--prm-learning-rate", "1e-3", "--group-size", "4"], False),
    ("qwen2", letters.NAME, "grpo", ["--lora-rank", "4", "--learning-rate", "1e-2", "--micro-rows", "2"],
     False),
    ("qwen3", letters.NAME, "dapo+empg", [], False),
    ("qwen2", "hotpotqa", "igpo", [], False),
    ("qwen3", "hotpotqa", "vineppo", ["--vine-rollouts", "2"], False),
    ("qwen2", "hotpotqa", "tree_grpo", ["--group-size", "4"], False),
    ("qwen2", letters.NAME, "spa", ["--progress-learning-rate", "1e-3"], False),
    ("qwen3", letters.NAME, "token_gae", [], False)])
def test_train_policy_qwen_learns_logs_checkpoints_and_resumes(tmp_path, toy_env, family, env, estimator,
                                                               extra, resume):
    model_dir, logdir = tmp_path / "model", tmp_path / "run"
    write(model_dir, family, seed=3)
    args = ["train", "--policy", "qwen", "--model-dir", str(model_dir), "--env", env,
            "--estimator", estimator, "--logdir", str(logdir), *SMALL, *extra]
    assert main([*args, "--iterations", "1"]) == 0
    rows = read_metrics(str(logdir))
    trained = [row for row in rows if row["iteration"] >= 0]
    assert [row["iteration"] for row in trained] == [0]
    assert all(np.isfinite(row["loss/total"]) and row["rows"] > 0 for row in trained)
    assert all(0 <= row["rollout/success"] <= 1 for row in trained)
    critic = advantages.get(estimator).needs_critic  # a value-head copy of the model learns beside
    assert all(("loss/value" in row) == critic and np.isfinite(row.get("loss/value", 0.0)) for row in trained)
    prm = estimator == "rloo+istar"  # its PRM copy takes a preference step each iteration
    assert all(("prm/loss" in row) == prm and np.isfinite(row.get("prm/loss", 0.0)) for row in trained)
    assert all(row["prm/num_pairs"] > 0 for row in trained if prm)
    dapo = estimator == "dapo+empg"  # DAPO's recipe: dynamic sampling and clip-higher
    assert all(("dapo/sampling_rounds" in row) == dapo for row in trained)
    forest = estimator == "tree_grpo"  # 4 leaves per task: one tree, a root and 3 branches
    assert all(row.get("tree/leaves", 4) == 4 and ("tree/leaves" in row) == forest for row in trained)
    spa = estimator == "spa"  # its progress estimator takes a step on the batch before the credit
    assert all(("progress/loss_after" in row) == spa for row in trained)
    vine = estimator == "vineppo"  # two continuations from every visited state
    assert all(("vine/states" in row) == vine and row.get("vine/env_steps", 1) > 0 for row in trained)
    igpo = estimator == "igpo"  # HotpotQA's answer, teacher-forced after each step's prompt
    assert all(("igpo/gain_mean" in row) == igpo and np.isfinite(row.get("igpo/gain_mean", 0.0))
               for row in trained)
    if "--eval-every" in extra:  # the initial policy and the last iteration are evaluated
        assert [row["iteration"] for row in rows if "eval/success" in row] == [-1, 0]
        assert all(row["loss/kl"] >= 0 for row in trained)
    saved = json.loads((logdir / "config.json").read_text())
    assert saved["policy"] == "qwen" and saved["estimator"] == estimator
    assert saved["lora_rank"] == (4 if "--lora-rank" in extra else 0)
    assert saved["micro_rows"] == (2 if "--micro-rows" in extra else 0)
    assert saved["critic_learning_rate"] == (1e-3 if "--critic-learning-rate" in extra else 1e-5)
    assert saved["loss"]["clip_high"] == (0.28 if estimator == "dapo+empg" else 0.2)
    assert saved["loss"]["step_level_ratio"] == ("--step-level-ratio" in extra)

    # The newest checkpoint holds the trained parameters: they moved away from the folder's.
    before = _params(model_dir)
    after = _restored(logdir, 1)
    drift = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    if env == letters.NAME:  # rewards differ within the group: the iteration moved the policy
        assert max(drift) > 1e-4

    if resume:  # iteration 0, then --resume for iteration 1: the run of two iterations in one go
        assert main([*args, "--iterations", "2", "--resume"]) == 0
        straight = tmp_path / "straight"
        assert main([*args[:args.index("--logdir")], "--logdir", str(straight),
                     *args[args.index("--logdir") + 2:], "--iterations", "2"]) == 0
        resumed = [row for row in read_metrics(str(logdir)) if row["iteration"] >= 0]
        uninterrupted = [row for row in read_metrics(str(straight)) if row["iteration"] >= 0]
        assert [row["iteration"] for row in resumed] == [0, 1]
        for key in ("loss/total", "loss/kl", "rollout/success", "rows"):
            np.testing.assert_allclose([row[key] for row in resumed],
                                       [row[key] for row in uninterrupted], rtol=1e-5, err_msg=key)
        for a, b in zip(jax.tree.leaves(_restored(logdir, 2)), jax.tree.leaves(_restored(straight, 2))):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_policy_qwen_takes_chat_model_defaults_where_no_flag_is_given():
    from stepcredit.cli import build_parser
    from stepcredit.train.qwen import DEFAULTS
    from stepcredit.train.train_command import config_from_args

    qwen = config_from_args(build_parser().parse_args(["train", "--policy", "qwen", "--model-dir", "m"]))
    word = config_from_args(build_parser().parse_args(["train"]))
    picked = {"learning_rate": qwen.learning_rate, "epochs": qwen.epochs,
              "minibatch_rows": qwen.minibatch_rows,
              "rollout.max_action_tokens": qwen.rollout.max_action_tokens,
              "rollout.history_window": qwen.rollout.history_window,
              "prm_learning_rate": qwen.prm_learning_rate,
              "progress_learning_rate": qwen.progress_learning_rate}
    assert picked == DEFAULTS and picked["learning_rate"] == 1e-6
    assert word.learning_rate == TrainConfig().learning_rate == 3e-4 and word.rollout.max_action_tokens == 12
    given = build_parser().parse_args(["train", "--policy", "qwen", "--model-dir", "m", "--epochs", "3"])
    assert config_from_args(given).epochs == 3


def test_train_policy_qwen_refuses_what_it_does_not_implement(tmp_path, capsys):
    model_dir = tmp_path / "model"
    base = ["train", "--policy", "qwen", "--model-dir", str(model_dir), "--logdir", str(tmp_path / "run")]
    for extra, message in ((["--d-model", "64"], "does not implement d_model: 256 -> 64"),
                           (["--estimator", "tree_grpo", "--tree-branching", "entropy"],
                            "records no entropies, so its trees branch at random"),
                           (["--model-dir", None], "model_dir is given with 'qwen' only")):
        argv = base + extra if extra[1] is not None else base[:3] + base[5:]
        assert main(argv) != 0
        assert message in capsys.readouterr().err
    assert main(["train", "--env", "http://127.0.0.1:9", "--logdir", str(tmp_path / "word")]) != 0
    assert "the word-level policy trains on a registered environment" in capsys.readouterr().err
    assert main(["train", "--critic-learning-rate", "1e-4", "--logdir", str(tmp_path / "word")]) != 0
    assert "a separate critic's rate (> 0) is for policy 'qwen'" in capsys.readouterr().err
    assert main(["train", "--lora-rank", "2", "--logdir", str(tmp_path / "word")]) != 0
    assert "LoRA (rank >= 1, alpha > 0) adapts policy 'qwen' only" in capsys.readouterr().err


def test_train_policy_qwen_on_a_served_environment_and_on_textworld_games(tmp_path):
    import subprocess

    from stepcredit.envs.http_server import create_app
    from tests.http.live_server import LiveServer
    from tests.textworld.test_textworld_env import _tw_make

    model_dir = tmp_path / "model"
    write(model_dir, "qwen3", seed=4)
    games = tmp_path / "games"
    for seed in (1, 2):
        subprocess.run([_tw_make(), "custom", "--world-size", "2", "--nb-objects", "3", "--quest-length", "2",
                        "--seed", str(seed), "--output", str(games / f"game{seed}.z8"), "--silent"],
                       check=True, capture_output=True, timeout=120)
    common = ["train", "--policy", "qwen", "--model-dir", str(model_dir), *SMALL, "--iterations", "1",
              "--eval-every", "1", "--eval-tasks", "1"]
    with LiveServer(create_app(lambda: envs.make("hotpotqa"))) as server:
        runs = {"served": server.url, "textworld": f"textworld:{games}/*.z8"}
        for name, spec in runs.items():
            assert main([*common, "--env", spec, "--logdir", str(tmp_path / name)]) == 0
    for name in runs:
        rows = read_metrics(str(tmp_path / name))
        assert [row["iteration"] for row in rows if "eval/success" in row] == [-1, 0]  # train tasks
        trained = [row for row in rows if row["iteration"] == 0 and "rows" in row]
        assert trained and trained[0]["rows"] >= 3 and np.isfinite(trained[0]["loss/total"])
