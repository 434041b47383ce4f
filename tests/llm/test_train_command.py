"""`stepcredit train --policy qwen`: a tiny random Qwen2 / Qwen3 trained on HotpotQA by the trainer's run."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from flax import nnx  # noqa: E402

from stepcredit.cli import main  # noqa: E402
from stepcredit.llm import checkpoint  # noqa: E402
from stepcredit.train.config import TrainConfig  # noqa: E402
from stepcredit.train.metrics import read_metrics  # noqa: E402
from stepcredit.train.qwen import QwenTrainer  # noqa: E402
from tests.llm.checkpoints import write  # noqa: E402

SMALL = ["--env", "hotpotqa", "--tasks-per-iteration", "1", "--group-size", "3", "--max-steps", "2",
         "--max-action-tokens", "6", "--history-window", "0", "--learning-rate", "1e-3",
         "--minibatch-rows", "4", "--checkpoint-every", "1"]


def _params(folder):
    return jax.tree.map(np.array, nnx.state(checkpoint.load(folder).model, nnx.Param))


@pytest.mark.parametrize("family, estimator, extra, resume", [
    ("qwen2", "grpo", ["--kl-coef", "0.1", "--eval-every", "1", "--eval-tasks", "1"], True),
    ("qwen3", "grpo+empg", ["--step-level-ratio"], False)])
def test_train_policy_qwen_learns_logs_checkpoints_and_resumes(tmp_path, family, estimator, extra, resume):
    model_dir, logdir = tmp_path / "model", tmp_path / "run"
    write(model_dir, family, seed=3)
    args = ["train", "--policy", "qwen", "--model-dir", str(model_dir), "--estimator", estimator,
            "--logdir", str(logdir), *SMALL, *extra]
    assert main([*args, "--iterations", "1"]) == 0
    rows = read_metrics(str(logdir))
    trained = [row for row in rows if row["iteration"] >= 0]
    assert [row["iteration"] for row in trained] == [0]
    assert all(np.isfinite(row["loss/total"]) and row["rows"] > 0 for row in trained)
    assert all(0 <= row["rollout/success"] <= 1 for row in trained)
    if "--eval-every" in extra:  # the initial policy and the last iteration are evaluated
        assert [row["iteration"] for row in rows if "eval/success" in row] == [-1, 0]
        assert all(row["loss/kl"] >= 0 for row in trained)
    saved = json.loads((logdir / "config.json").read_text())
    assert saved["policy"] == "qwen" and saved["estimator"] == estimator
    assert saved["loss"]["step_level_ratio"] == ("--step-level-ratio" in extra)

    # The newest checkpoint holds the trained parameters: they moved away from the folder's.
    before = _params(model_dir)
    trainer = QwenTrainer(TrainConfig.from_json((logdir / "config.json").read_text()), log=lambda _: None)
    assert trainer.restore() == 1
    after = jax.tree.map(np.array, trainer.learner.params)
    drift = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    assert max(drift) > 0

    if resume:  # a resumed run continues at iteration 1 without redoing 0
        assert main([*args, "--iterations", "2", "--resume"]) == 0
        assert [row["iteration"] for row in read_metrics(str(logdir)) if row["iteration"] >= 0] == [0, 1]


def test_train_policy_qwen_refuses_what_it_does_not_implement(tmp_path, capsys):
    model_dir = tmp_path / "model"
    base = ["train", "--policy", "qwen", "--model-dir", str(model_dir), "--logdir", str(tmp_path / "run")]
    for extra, message in ((["--d-model", "64"], "does not implement d_model: 256 -> 64"),
                           (["--estimator", "token_gae"], "estimator 'token_gae' needs a critic"),
                           (["--estimator", "rloo+istar"], "estimator 'rloo+istar' needs an implicit PRM"),
                           (["--model-dir", None], "model_dir is given with 'qwen' only")):
        argv = base + extra if extra[1] is not None else base[:3] + base[5:]
        assert main(argv) != 0
        assert message in capsys.readouterr().err
