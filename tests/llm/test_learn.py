"""Step rows of chat-model trajectories: each step's advantage on its own action tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from stepcredit.batch import StepRecord, Trajectory  # noqa: E402
from flax import nnx  # noqa: E402

from stepcredit.llm import learn  # noqa: E402
from stepcredit.train.update import LossConfig  # noqa: E402


def test_step_rows_put_each_step_advantage_on_its_action_tokens():
    trajectory = Trajectory(steps=(
        StepRecord(observation_ids=[], action_ids=[7, 8], action_logp=[-1.0, -2.0], reward=0.0,
                   prompt_ids=[1, 2, 3]),
        StepRecord(observation_ids=[], action_ids=[9], action_logp=[-0.5], reward=1.0, prompt_ids=[1, 4])))
    rows = learn.step_rows([trajectory], np.array([[0.25, -1.5]], np.float32))
    pad = [0, 0, 0]  # rows are padded to a power of two (8): one compiled update per bucket
    np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 7, 8] + pad, [1, 4, 9, 0, 0] + pad])
    np.testing.assert_array_equal(rows["action_mask"], [[0, 0, 0, 1, 1] + pad, [0, 0, 1, 0, 0] + pad])
    np.testing.assert_array_equal(rows["advantages"], [[0, 0, 0, 0.25, 0.25] + pad, [0, 0, -1.5, 0, 0] + pad])
    np.testing.assert_array_equal(rows["old_logp"], [[0, 0, 0, -1, -2] + pad, [0, 0, -0.5, 0, 0] + pad])
    with pytest.raises(ValueError, match="step_rows: trajectories hold no steps"):
        learn.step_rows([Trajectory(steps=())], np.zeros((1, 0), np.float32))
    with pytest.raises(ValueError, match=r"step_advantages has shape \(2,\); it must be \[B, T\]"):
        learn.step_rows([trajectory], np.zeros(2, np.float32))


def test_with_entropies_puts_each_row_entropy_on_its_step():
    steps = (StepRecord(observation_ids=[], action_ids=[7, 8], action_logp=[-1.0, -2.0], reward=0.0,
                        prompt_ids=[1, 2, 3]),
             StepRecord(observation_ids=[], action_ids=[], action_logp=[], reward=1.0, prompt_ids=[1, 4]))
    trajectories = [Trajectory(steps=steps), Trajectory(steps=steps[:1])]
    rows = learn.step_rows(trajectories, np.zeros((2, 2), np.float32))
    entropy = np.arange(rows["tokens"].size, dtype=np.float32).reshape(rows["tokens"].shape)
    out = learn.with_entropies(trajectories, rows, entropy)
    width = rows["tokens"].shape[1]
    assert out[0].steps[0].action_entropy == [3.0, 4.0]  # row 0, positions 3 and 4
    assert out[0].steps[1].action_entropy is None  # no token sampled: no entropy (not NaN)
    assert out[1].steps[0].action_entropy == [2 * width + 3.0, 2 * width + 4.0]


def _learner(tmp_path, **settings):
    from stepcredit.llm import checkpoint
    from tests.llm.checkpoints import write

    write(tmp_path / "model", "qwen2", seed=5)
    qwen = checkpoint.load(tmp_path / "model", dtype=settings.pop("dtype", "float32"))
    return learn.Learner(qwen, learn.LearnConfig(**settings))


def _group(learner, actions, rewards):
    """One task's group: each episode one step answering the same prompt with `actions[i]`, its
    stored log-probs those of the learner's current parameters (a fresh on-policy batch)."""
    prompt = [1, 20, 21, 22, 23]
    trajectories = [Trajectory(steps=(StepRecord(
        observation_ids=[], action_ids=list(action), action_logp=[0.0] * len(action), reward=reward,
        prompt_ids=prompt),), group_id=0) for action, reward in zip(actions, rewards)]
    rows = learn.step_rows(trajectories, np.zeros((len(trajectories), 1), np.float32))
    logp, _ = learner.score(learner.params, rows, with_entropy=False)
    return [Trajectory(steps=(dataclasses.replace(t.steps[0], action_logp=logp[r][rows["action_mask"][r]]
                                                  .tolist()),), group_id=0)
            for r, t in enumerate(trajectories)], rows


def _action_logp(learner, rows):
    logp, _ = learner.score(learner.params, rows, with_entropy=False)
    return np.where(rows["action_mask"], logp, 0.0).sum(axis=1)


def test_learn_raises_the_rewarded_answer_and_lowers_the_others_under_the_kl_term(tmp_path):
    learner = _learner(tmp_path, estimator="grpo", learning_rate=3e-3, epochs=2, minibatch_rows=3,
                       loss=LossConfig(kl_coef=0.1))
    actions, rewards = [[30, 31], [40, 41], [50, 51, 52], [60]], [1.0, 0.0, 0.0, 0.0]
    trajectories, rows = _group(learner, actions, rewards)
    before = _action_logp(learner, rows)
    metrics = learner.learn(trajectories, iteration=0)  # 4 rows: a minibatch of 3, one of 1 padded to 3
    after = _action_logp(learner, rows)
    assert metrics["rows"] == 4 and metrics["loss/policy"] < 0  # GRPO: +1.5 / -0.5 advantages
    assert after[0] > before[0] + 0.05 and np.all(after[1:] < before[1:])
    assert metrics["loss/kl"] > 0  # the second epoch's minibatches have left the reference
    learner.learn(trajectories, iteration=1)  # state placed as the update returns it: no recompile
    assert learner._micro._cache_size() == 1 and learner._apply._cache_size() == 1
    np.testing.assert_allclose(learner.score(learner.reference, rows, with_entropy=False)[0],
                               learner.score(_learner(tmp_path).params, rows, with_entropy=False)[0],
                               atol=1e-6)  # the reference is the initial model, untouched


def _update_from_start(learner, chunk):
    """The parameters after one `_policy_update` of `chunk` from the learner's initial state."""
    start = learner.params, learner.opt_state
    learner._policy_update(chunk)
    moved = jax.tree.map(np.array, learner.params)
    learner.params, learner.opt_state = start
    return moved


@pytest.mark.parametrize("loss", [LossConfig(kl_coef=0.2), LossConfig(agg="seq-mean-token-mean"),
                                  LossConfig(step_level_ratio=True)])
def test_a_minibatch_step_is_the_same_padded_or_in_micro_batches(tmp_path, loss):
    learner = _learner(tmp_path, estimator="grpo", learning_rate=3e-3, loss=loss)
    trajectories, rows = _group(learner, [[30, 31], [40], [50, 51, 52]], [1.0, 0.0, 0.5])
    rows["advantages"] = np.where(rows["action_mask"], np.array([[1.0], [-1.0], [0.25]]), 0.0
                                  ).astype(np.float32)
    rows["ref_logp"] = rows["old_logp"] - 0.1
    index = np.arange(3)
    exact = _update_from_start(learner, learn._padded_rows(rows, index, 3, on_device=False))
    padded = _update_from_start(learner, learn._padded_rows(rows, index, 8, on_device=False))
    micro = learn.Learner(learner.qwen, dataclasses.replace(learner.config, micro_rows=2))
    in_micro_batches = _update_from_start(micro, learn._padded_rows(rows, index, 8, on_device=False))
    for want, *got in zip(jax.tree.leaves(exact), jax.tree.leaves(padded), jax.tree.leaves(in_micro_batches)):
        for leaf in got:  # empty rows add nothing; micro-batches of 2 rows (3 real, 5 empty) add up
            np.testing.assert_allclose(leaf, want, atol=1e-6)


def test_score_in_chunks_equals_one_call_and_the_entropy_its_definition(tmp_path):
    learner = _learner(tmp_path, minibatch_rows=2)
    _, rows = _group(learner, [[30, 31], [40], [50, 51, 52]], [0.0, 0.0, 0.0])
    logp, entropy = learner.score(learner.params, rows, with_entropy=True)  # calls of 2 rows, then 1
    whole = learn.Learner(learner.qwen, learn.LearnConfig()).score(learner.params, rows, with_entropy=True)
    np.testing.assert_allclose(logp, whole[0], atol=1e-5)
    np.testing.assert_allclose(entropy, whole[1], atol=1e-5)
    logits = learn.checkpoints.logits(learner.qwen, rows["tokens"], rows["mask"])
    p = jax.nn.softmax(np.asarray(logits[:, :-1], np.float64), axis=-1)
    np.testing.assert_allclose(entropy[:, 1:], -(p * np.log(p)).sum(-1), rtol=1e-4)


def test_bfloat16_models_learn_on_float32_masters(tmp_path):
    learner = _learner(tmp_path, dtype="bfloat16", estimator="grpo", learning_rate=1e-6)
    assert {leaf.dtype for leaf in jax.tree.leaves(learner.params)} == {np.dtype(np.float32)}
    trajectories, _ = _group(learner, [[30, 31], [40]], [1.0, 0.0])
    start = jax.tree.map(np.array, learner.params)
    learner.learn(trajectories, iteration=0)
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(start))]
    assert 0 < max(moved) < 1e-5  # an update of 1e-6, kept (bfloat16 weights would round it away)
    model = nnx.state(learner.qwen.model, nnx.Param)
    for held, master in zip(jax.tree.leaves(model), jax.tree.leaves(learner.params)):
        assert held.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(held), np.asarray(master.astype(jnp.bfloat16)))


def _cut_group(learner):
    """Two one-step episodes, the second cut by the step limit in a state whose prompt is kept."""
    trajectories, rows = _group(learner, [[30, 31], [40]], [1.0, 0.0])
    last = dataclasses.replace(trajectories[1].steps[0], truncated=True,
                               info={"next_prompt_ids": [1, 20, 21, 40, 24, 25]})
    return [trajectories[0], dataclasses.replace(trajectories[1], steps=(last,))], rows


def test_the_step_critic_values_each_prompt_bootstraps_a_cut_episode_and_learns_its_returns(tmp_path):
    learner = _learner(tmp_path, estimator="step_gae", critic_learning_rate=1e-2, epochs=3,
                       estimator_config=(("gamma", 1.0), ("lam", 1.0)))
    trajectories, rows = _cut_group(learner)
    assert np.all(learner.values(rows) == 0)  # the zero head: V = 0 until the critic learns
    for _ in range(3):
        metrics = learner.learn(trajectories, iteration=0)
    assert np.isfinite(metrics["loss/value"])
    rows["old_values"] = learner.values(rows)
    valued = learner._with_values(trajectories, rows)
    # V(s_t) is read where the prompt ends: the same on a row of the prompt alone.
    prompt_only = {"tokens": np.zeros((1, 8), np.int32), "mask": np.zeros((1, 8), bool)}
    prompt_only["tokens"][0, :5], prompt_only["mask"][0, :6] = [1, 20, 21, 22, 23], True
    alone = learner.values(prompt_only)[0, 5]
    np.testing.assert_allclose([t.steps[0].value for t in valued], [alone, alone], atol=1e-5)
    cut = {"tokens": np.zeros((1, 8), np.int32), "mask": np.zeros((1, 8), bool)}
    cut["tokens"][0, :6], cut["mask"][0, :7] = [1, 20, 21, 40, 24, 25], True
    np.testing.assert_allclose(valued[1].bootstrap_value, learner.values(cut)[0, 6], atol=1e-5)
    assert valued[0].bootstrap_value == 0.0 and valued[1].bootstrap_value != 0.0
    # Returns with gamma = lam = 1: 1 for the won episode, V(s_next) for the cut one; the
    # critic, shared by both steps' identical prompt, moved from 0 toward their mean.
    assert 0.1 < alone < 1.0


def test_token_values_go_to_the_collated_batch_and_back(tmp_path):
    from stepcredit.batch import collate

    learner = _learner(tmp_path, estimator="token_gae")
    steps = (StepRecord(observation_ids=[], action_ids=[7, 8], action_logp=[0.0, 0.0], reward=0.0,
                        prompt_ids=[1, 2, 3]),
             StepRecord(observation_ids=[], action_ids=[9], action_logp=[0.0], reward=1.0, prompt_ids=[1, 4]))
    trajectories = [Trajectory(steps=steps), Trajectory(steps=steps[1:])]
    rows = learn.step_rows(trajectories, np.zeros((2, 2), np.float32))
    _, tokens, _ = collate(trajectories, with_observations=False)
    row_values = np.where(rows["action_mask"], np.arange(rows["tokens"].size).reshape(rows["tokens"].shape),
                          0).astype(np.float32)
    laid_out = learn._to_tokens(row_values, rows, tokens)
    np.testing.assert_array_equal(laid_out[:, :3], [[3, 4, 8 + 2], [2 * 8 + 2, 0, 0]])  # 8 r + n
    np.testing.assert_array_equal(learn._to_rows(laid_out, rows, tokens), row_values)
    assert learner.critic_level == "token" and learn.Learner(
        learner.qwen, learn.LearnConfig(estimator="grpo")).critic is None


def test_the_prm_step_accumulated_over_chunks_is_the_whole_batch_gradient_step(tmp_path):
    from stepcredit.advantages import trajectory_preference_loss
    from stepcredit.batch import collate
    from stepcredit.train.update import make_optimizer

    learner = _learner(tmp_path, estimator="rloo+istar", minibatch_rows=1, prm_learning_rate=1e-3)
    trajectories, rows = _group(learner, [[30, 31], [40, 41], [50, 51]], [1.0, 0.0, 0.0])
    trajectories = [dataclasses.replace(t, steps=(dataclasses.replace(t.steps[0], info={"score": r}),))
                    for t, r in zip(trajectories, [1.0, 0.0, 0.0])]
    steps, tokens, _ = collate(trajectories, with_observations=False)
    assert list(steps.score) == [1.0, 0.0, 0.0]
    start = learner.prm
    old_logp = learn._to_tokens(learner.score(learner.params, rows, with_entropy=False)[0], rows, tokens)
    _, metrics = learner.update_prm(rows, tokens, steps, old_logp)  # three chunks of one row
    assert metrics["prm/num_pairs"] == 2

    def whole_batch_loss(prm):  # every answer is 2 tokens after the same 5-token prompt
        logp, _ = learn._token_scores(learner.graphdef, prm, learner.frozen["rest"], rows, 1.0,
                                      with_entropy=False)
        return trajectory_preference_loss(logp[:, 5:7], old_logp[:, :2], tokens.action_mask[:, :2],
                                          tokens.step_index[:, :2], steps.score > 0, steps.group_id,
                                          beta=learner.estimator_config["beta"])[0]

    tx = make_optimizer(learning_rate=1e-3, weight_decay=0.0, grad_clip=10.0)
    with jax.set_mesh(learner.qwen.mesh):
        grads = jax.jit(jax.grad(whole_batch_loss))(start)
    expected = optax.apply_updates(start, tx.update(grads, tx.init(start), start)[0])
    for got, want in zip(jax.tree.leaves(learner.prm), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert max(float(np.abs(a - b).max()) for a, b in
               zip(jax.tree.leaves(learner.prm), jax.tree.leaves(start))) > 1e-4


def test_lora_starts_at_the_pretrained_model_and_trains_only_its_adapters(tmp_path):
    from stepcredit.llm import lora

    learner = _learner(tmp_path, estimator="grpo", learning_rate=1e-2, lora_rank=2, lora_alpha=4.0,
                       loss=LossConfig(kl_coef=0.1))
    base = jax.tree.map(np.array, learner.frozen["base"])
    adapted = set(learner.params)  # the decoder layers' kernels, none of the embeddings or norms
    assert len(adapted) == 2 * 7 and all("'layers'" in name and "norm" not in name for name in adapted)
    assert learner.params[next(iter(adapted))]["a"].shape[-1] == 2
    trajectories, rows = _group(learner, [[30, 31], [40, 41]], [1.0, 0.0])
    full = _learner(tmp_path / "full")  # B = 0: the adapted model scores as the pretrained one
    np.testing.assert_allclose(learner.score(learner.params, rows, with_entropy=False)[0],
                               full.score(full.params, rows, with_entropy=False)[0], atol=1e-6)
    before = _action_logp(learner, rows)
    metrics = learner.learn(trajectories, iteration=0)
    after = _action_logp(learner, rows)
    assert after[0] > before[0] and after[1] < before[1] and "loss/kl" in metrics
    for frozen, start in zip(jax.tree.leaves(learner.frozen["base"]), jax.tree.leaves(base)):
        np.testing.assert_array_equal(frozen, start)
    # the model the sampler holds is the pretrained weights with the adapters merged in
    held = nnx.state(learner.qwen.model, nnx.Param)
    expected = lora.merged(learner.frozen["base"], learner.params, scale=4.0 / 2)
    moved = 0
    for got, want, start in zip(jax.tree.leaves(held), jax.tree.leaves(expected), jax.tree.leaves(base)):
        np.testing.assert_allclose(got, want, atol=1e-6)
        moved += int(np.abs(np.asarray(want) - start).max() > 0)
    assert moved == len(adapted)
    with pytest.raises(ValueError, match="lora.init: rank=0; it must be >= 1"):
        lora.init(learner.frozen["base"], rank=0, hidden_size=32, key=jax.random.key(0))


def test_answer_beliefs_are_the_mean_log_prob_of_the_answer_after_each_prompt(tmp_path):
    learner = _learner(tmp_path, estimator="igpo")
    tokenizer = learner.qwen.tokenizer
    prefix, answer = tokenizer.encode("<action>finish[", add_special_tokens=False), "yes"
    ids = tokenizer.encode(answer, add_special_tokens=False)
    steps = tuple(StepRecord(observation_ids=[], action_ids=[30], action_logp=[0.0], reward=0.0,
                             prompt_ids=prompt) for prompt in ([1, 20, 21], [1, 22, 23, 24]))
    trajectories = [Trajectory(steps=steps, answer=answer), Trajectory(steps=steps[:1])]
    beliefs = learner.answer_beliefs(trajectories, prefix)
    assert beliefs.shape == (2, 2) and beliefs[1, 0] == 0.0  # no answer: no belief
    for t, step in enumerate(steps):
        row = [*step.prompt_ids, *prefix, *ids]
        logp = jax.nn.log_softmax(learn.checkpoints.logits(learner.qwen, [row], [[True] * len(row)])[0], -1)
        start = len(row) - len(ids)
        expected = np.mean([float(logp[start + k - 1, token]) for k, token in enumerate(ids)])
        np.testing.assert_allclose(beliefs[0, t], expected, atol=1e-5)
    np.testing.assert_array_equal(learner.answer_beliefs(trajectories, None), np.zeros((2, 2)))


def test_the_progress_estimator_fits_outcomes_with_the_same_steps_in_chunks_or_whole(tmp_path):
    from stepcredit.batch import collate

    settings = dict(estimator="spa", progress_learning_rate=3e-3, progress_steps=3)
    chunked = _learner(tmp_path / "a", minibatch_rows=1, **settings)
    whole = _learner(tmp_path / "b", **settings)
    trajectories, rows = _group(chunked, [[30, 31], [40, 41], [50]], [1.0, 0.0, 0.5])
    steps, _, _ = collate(trajectories, with_observations=False)
    fitted = [learner.update_progress(rows, steps, trajectories) for learner in (chunked, whole)]
    (inputs, metrics), (whole_inputs, _) = fitted
    np.testing.assert_allclose(inputs["progress"], whole_inputs["progress"], atol=1e-5)
    assert metrics["progress/loss"] == pytest.approx(np.mean(np.square([1.0, 0.0, 0.5])))  # c = 0 at first
    assert metrics["progress/loss_after"] < 0.5 * metrics["progress/loss"]
    assert inputs["grounding"].tolist() == [[True]] * 3
