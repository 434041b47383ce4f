"""stepcredit.compat.tunix against tunix 0.1.7: its registry, and its agentic GRPO learner
trained on a tiny random Qwen2 with per-turn credit (no download)."""

import dataclasses
import itertools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from stepcredit.advantages import registry
from stepcredit.advantages.inputs import CreditInputs
from stepcredit.compat import tunix as compat
from stepcredit.keys import dense_ids, stable_keys

function_registry = pytest.importorskip("tunix.rl.function_registry",
                                        reason="tunix is installed by the README's test command")
from tunix.generate import tokenizer_adapter  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.agentic import agentic_grpo_learner  # noqa: E402
from tunix.rl.agentic.agents import agent_types  # noqa: E402
from tunix.rl.agentic.environments import base_environment  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


@pytest.mark.parametrize("name", ["grpo", "rloo", "drgrpo"])
def test_registered_estimators_equal_tunix_own(name):
    names = compat.register()
    assert "stepcredit_" + name in names and "stepcredit_maxrl" in names
    rewards = np.random.default_rng(0).integers(0, 3, 12).astype(np.float32) * 0.5
    theirs = np.asarray(function_registry.get_advantage_estimator(name)(rewards=rewards, num_generations=4))
    ours = function_registry.get_advantage_estimator("stepcredit_" + name)(rewards=rewards, num_generations=4)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="groups of num_generations=5"):
        function_registry.get_advantage_estimator("stepcredit_" + name)(rewards=rewards, num_generations=5)


def test_turn_inputs_place_each_step_reward_on_its_turn():
    mask = np.array([[1, 1, 0, 0, 1, 0, 0, 1, 1, 1], [1, 0, 0, 1, 1, 1, 1, 1, 1, 1]], np.float32)
    records = [{"step_rewards": [0.5, 0.0, 2.0, 7.0], "step_assistant_lens": [2, 1, 3, 0],
                "step_env_lens": [2, 2, 2, 0], "step_states": ["s0", "s1", "s2", "s3"]},
               {"step_rewards": [1.0, 3.0], "step_assistant_lens": [1, 9], "step_env_lens": [2, 0],
                "step_states": ["s0", "s4"]}]
    out = compat.turn_inputs(records, mask)
    expected = np.zeros_like(mask)
    expected[0, [1, 4, 9]] = [0.5, 0.0, 2.0]
    expected[0, 9] += 7.0  # a turn that generated nothing: its reward on the token before it
    expected[1, [0, 9]] = [1.0, 3.0]  # a turn cut off at the end: its reward on the last token
    np.testing.assert_array_equal(out["token_level_rewards"], expected)
    assert out["anchor_obs"][0] == ["s0", "s1", "s2"] and out["anchor_obs"][1] == ["s0", "s4"]


def test_turn_inputs_merge_steps_without_a_reply_into_one_turn():
    # Step 1 got no environment reply: its tokens and step 2's form one run of the mask.
    mask = np.array([[1, 1, 0, 1, 1, 1, 0, 1]], np.float32)
    records = [{"step_rewards": [1.0, 2.0, 3.0, 4.0], "step_assistant_lens": [2, 1, 2, 1],
                "step_env_lens": [1, 0, 1, 0], "step_states": ["s0", "s1", "s2", "s3"]}]
    out = compat.turn_inputs(records, mask)
    assert list(out["anchor_obs"][0]) == ["s0", "s1", "s3"]
    np.testing.assert_array_equal(out["token_level_rewards"][0], [0, 1, 0, 2, 0, 3, 0, 4])


# ---------------------------------------------------------------- the learner, end to end

WORDS = ["<pad>", "<s>", "</s>", "[UNK]", "System:", "User:", "Assistant:", "guess", "the", "digit",
         "wrong", "try", "again", "correct", "room"] + [str(i) for i in range(10)]
STEPS_PER_TURN = 3  # a random model rarely stops: cap each turn so that episodes have 3 turns
MAX_RESPONSE = 36


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")
    return tokenizer_adapter.TokenizerAdapter(PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="[UNK]"))


class ChatParser:
    assistant_token = "Assistant: "

    def parse(self, messages, add_generation_prompt=False, is_first_msg=False):
        roles = {"system": "System:", "user": "User:", "assistant": "Assistant:", "tool": "User:"}
        text = "".join(f" {roles[m['role']]} {m['content']}" for m in messages)
        return text + (" " + self.assistant_token if add_generation_prompt else "")


class GuessDigit(base_environment.BaseTaskEnv):
    """Three turns; each reply is told which of two rooms it reached; 1 for the right digit."""

    def __init__(self, single_example, **kwargs):
        super().__init__(task=single_example, max_steps=3, **kwargs)
        self.target = str(np.asarray(single_example["answer"]).reshape(-1)[0])

    def _initial_observation(self):
        return {"prompts": "guess the digit"}

    def _step_impl(self, action):
        words = str(action.action if isinstance(action, agent_types.Action) else action).split()
        correct = self.target in words
        room = sum(w.isdigit() for w in words) % 2
        return base_environment.EnvStepResult(observation=f"wrong room {room}" if not correct else "correct",
                                              reward=1.0 if correct else 0.1 * room, done=correct, info={})


@pytest.mark.parametrize("estimator, reads", [("step_gae", "step_values"), ("empg", "entropy"),
                                               ("istar", "implicit_step_rewards")])
def test_turn_learner_refuses_an_estimator_whose_inputs_it_does_not_record(estimator, reads):
    with pytest.raises(ValueError, match=f"turn_learner: estimator '{estimator}' reads .*{reads}"):
        compat.turn_learner(estimator)


def test_turn_learner_trains_qwen2_with_gigpo_turn_advantages():
    compat.register()
    captured = []
    parent = compat.turn_learner("gigpo", {"omega": 1.0})

    class Probe(parent):
        def _model_call(self, chat_lists, env=None, max_generation_steps=None):
            cap = min(STEPS_PER_TURN, max_generation_steps or STEPS_PER_TURN)
            return super()._model_call(chat_lists, env, max_generation_steps=cap)

        def _process_results(self, trajectories, *args, **kwargs):
            examples = super()._process_results(trajectories, *args, **kwargs)
            captured.append(([item.traj for item in trajectories], [item.group_id for item in trajectories],
                             examples))
            return examples

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = qwen2.ModelConfig(num_layers=1, vocab_size=32, embed_dim=32, hidden_dim=64, num_heads=2,
                               head_dim=16, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6,
                               use_tied_embedding=False)
    with jax.set_mesh(mesh):
        actor, reference = qwen2.Qwen2(config, rngs=nnx.Rngs(0)), qwen2.Qwen2(config, rngs=nnx.Rngs(0))
    before = jax.tree.map(np.array, nnx.state(actor, nnx.Param))
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                                  rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=2, mini_batch_size=1,
                train_micro_batch_size=1),
            rollout_config=base_rollout.RolloutConfig(
                max_prompt_length=96, max_tokens_to_generate=MAX_RESPONSE, return_logprobs=True,
                kv_cache_size=96 + MAX_RESPONSE + 8, temperature=1.0)))
    # tunix's vanilla sampler reuses one key when no seed is given: every member of a group
    # would be the same sample. A fresh seed per call.
    generate, seeds = cluster.rollout.generate, itertools.count(1)
    cluster.rollout.generate = lambda prompts, rollout_config, **kw: generate(
        prompts, dataclasses.replace(rollout_config, seed=next(seeds)), **kw)
    learner = Probe(rl_cluster=cluster, reward_fns=None, chat_parser=ChatParser(), env_class=GuessDigit,
                    algo_config=agentic_grpo_learner.GRPOConfig(
                        num_generations=4, num_iterations=1, beta=0.0, max_response_length=MAX_RESPONSE,
                        max_concurrency=4))
    learner.train([{"prompts": ["guess the digit"], "answer": [str(d)]} for d in (3, 7)])
    assert cluster.actor_trainer.train_steps == 2
    after = jax.tree.map(np.array, nnx.state(actor, nnx.Param))
    assert any(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))

    checked_turns, largest, longest = 0, 0.0, 0
    for records, group_ids, [example] in captured:
        mask = np.asarray(example.completion_mask) > 0
        advantages = np.asarray(example.advantages)
        assert advantages.shape == mask.shape and (advantages[~mask] == 0).all()
        # stepcredit's GiGPO straight from the recorded steps: [B, T] arrays by a Python loop
        size = len(records)
        turns = max(sum(1 for g in r["step_assistant_lens"] if g) for r in records)
        step_rewards, anchors = np.zeros((size, turns), np.float32), np.full((size, turns), -1, np.int32)
        valid, spans = np.zeros((size, turns), bool), []
        keys = {}
        for b, record in enumerate(records):
            start, k, row_spans = 0, 0, []
            steps = zip(record["step_rewards"], record["step_assistant_lens"], record["step_env_lens"],
                        record["step_states"])
            for reward, generated, replied, state in steps:
                if generated and start < mask.shape[1]:
                    step_rewards[b, k] += reward
                    anchors[b, k] = keys.setdefault(int(stable_keys(np.array([state], dtype=object))[0]),
                                                    len(keys))
                    valid[b, k] = True
                    row_spans.append((start, min(start + generated, mask.shape[1])))
                    k += 1
                elif k:
                    step_rewards[b, k - 1] += reward
                start += generated + replied
            spans.append(row_spans)
        groups = dense_ids(np.asarray(group_ids, dtype=object).astype(str), order="first")[0]
        expected = np.asarray(registry.apply(
            "gigpo", CreditInputs(step_rewards=step_rewards, anchors=anchors, group_ids=groups, mask=valid),
            {"omega": 1.0, "gamma": 1.0}).advantages)
        for b, row_spans in enumerate(spans):
            for k, (start, stop) in enumerate(row_spans):
                np.testing.assert_allclose(advantages[b, start:stop], expected[b, k], atol=1e-5)
                checked_turns += 1
            longest = max(longest, len(row_spans))
        largest = max(largest, float(np.abs(advantages).max()))
    assert checked_turns >= 8 and longest >= 2 and largest > 0.01  # multi-turn, not all zero
