"""Cached generation: token-exact log-probs, cache vs full forward, stopping."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stepcredit.models.generate import generate
from stepcredit.models.transformer import (
    TransformerConfig,
    TransformerPolicy,
    forward,
    label_positions,
    pack_rows,
    score_rows,
)

V, P, M, PAD, EOA = 64, 8, 6, 0, 2
NEVER = V              # an end-of-action id outside the vocabulary: no row stops
CONFIG = TransformerConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=2, mlp_dim=64)


def _policy():
    model = TransformerPolicy(CONFIG, rngs=nnx.Rngs(3))
    head = model.value_head.kernel
    head[...] = jax.random.normal(jax.random.key(4), head[...].shape)
    # Sharpen the initial near-uniform distribution so that samples differ in
    # probability and greedy decoding has clear winners.
    emb = model.embed.embedding
    emb[...] = emb[...] * 4
    return model


GRAPHDEF, STATE = nnx.split(_policy())
PROMPTS = [[1, 5, 9, 11, 4, 7, 30, 8], [1, 12, 13], [1, 40, 41, 42, 43]]
ROWS = pack_rows(PROMPTS, length=P, pad_id=PAD, side="left")


def _generate(key, temperature, eoa_id=EOA):
    return jax.tree.map(np.asarray, generate(
        GRAPHDEF, STATE, ROWS.tokens, ROWS.mask, key, max_new_tokens=M, eoa_id=eoa_id,
        pad_id=PAD, temperature=temperature))


def _rescore(gen, temperature):
    """Scores prompt + generated ids with one full forward pass (no re-tokenization)."""
    actions = [gen.tokens[b, :gen.lengths[b]] for b in range(len(PROMPTS))]
    rows = pack_rows(PROMPTS, actions, length=P + M, pad_id=PAD, side="left")
    scores = jax.tree.map(np.asarray, score_rows(GRAPHDEF, STATE, rows.tokens, rows.mask,
                                                 temperature))
    return rows, scores


def test_generation_logprobs_equal_a_full_forward_pass():
    for temperature in (1.0, 0.7):
        gen = _generate(jax.random.key(0), temperature)
        rows, scores = _rescore(gen, temperature)
        for b in range(len(PROMPTS)):
            n = gen.lengths[b]
            np.testing.assert_allclose(gen.logprobs[b, :n], scores.logprobs[b][rows.action_mask[b]],
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(gen.entropies[b, :n],
                                       scores.entropies[b][rows.action_mask[b]],
                                       rtol=1e-4, atol=1e-5)
            first_action = np.flatnonzero(rows.action_mask[b])[0]
            np.testing.assert_allclose(gen.values[b], scores.values[b, first_action],
                                       rtol=1e-4, atol=1e-5)
            assert np.all(gen.logprobs[b, n:] == 0) and np.all(gen.tokens[b, n:] == PAD)
        assert np.all(gen.logprobs[:, 0] < 0) and np.all(gen.entropies[:, 0] > 0)


def test_cached_generation_after_prompts_longer_than_an_attention_block():
    # The prefill attends by blocks of ATTENTION_BLOCK columns; the scorer's rows are wider.
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(3, V, n)) for n in (150, 90, 20)]
    width = max(map(len, prompts))
    rows = pack_rows(prompts, length=width, pad_id=PAD, side="left")
    gen = jax.tree.map(np.asarray, generate(GRAPHDEF, STATE, rows.tokens, rows.mask,
                                            jax.random.key(5), max_new_tokens=M, eoa_id=EOA,
                                            pad_id=PAD))
    actions = [gen.tokens[b, :gen.lengths[b]] for b in range(len(prompts))]
    scored_rows = pack_rows(prompts, actions, length=width + M, pad_id=PAD, side="right")
    scores = jax.tree.map(np.asarray, score_rows(GRAPHDEF, STATE, scored_rows.tokens,
                                                 scored_rows.mask))
    for b in range(len(prompts)):
        np.testing.assert_allclose(gen.logprobs[b, :gen.lengths[b]],
                                   scores.logprobs[b][scored_rows.action_mask[b]],
                                   rtol=1e-4, atol=1e-5)


def test_sampling_depends_on_the_key_only():
    a, b = _generate(jax.random.key(1), 1.0), _generate(jax.random.key(1), 1.0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, _generate(jax.random.key(2), 1.0).tokens)


def _greedy_without_cache():
    """Greedy decoding by a full forward pass over the whole row for every new token."""
    tokens = np.concatenate([ROWS.tokens, np.full((len(PROMPTS), M), PAD, np.int32)], axis=1)
    mask = np.concatenate([ROWS.mask, np.zeros((len(PROMPTS), M), bool)], axis=1)
    for i in range(M):
        logits, _ = forward(GRAPHDEF, STATE, tokens, mask)
        tokens[:, P + i] = np.argmax(np.asarray(logits[:, P + i - 1]), axis=-1)
        mask[:, P + i] = True
    return tokens[:, P:]


def test_greedy_generation_with_and_without_cache_gives_identical_tokens():
    gen = _generate(jax.random.key(0), 0.0, eoa_id=NEVER)
    assert np.all(gen.lengths == M) and not np.any(gen.finished)
    np.testing.assert_array_equal(gen.tokens, _greedy_without_cache())
    # Greedy log-probs are those of softmax(logits), the T = 1 policy.
    rows, scores = _rescore(gen, 1.0)
    np.testing.assert_allclose(gen.logprobs, scores.logprobs[rows.action_mask].reshape(-1, M),
                               rtol=1e-4, atol=1e-5)


def test_rows_stop_after_the_end_of_action_token():
    free = _generate(jax.random.key(0), 0.0, eoa_id=NEVER)
    stop_id = int(free.tokens[0, 2])                 # greedy: the same tokens until a stop
    gen = _generate(jax.random.key(0), 0.0, eoa_id=stop_id)
    for b in range(len(PROMPTS)):
        hits = np.flatnonzero(free.tokens[b] == stop_id)
        n = hits[0] + 1 if len(hits) else M
        assert gen.lengths[b] == n and gen.finished[b] == bool(len(hits))
        np.testing.assert_array_equal(gen.tokens[b, :n], free.tokens[b, :n])
        assert np.all(gen.tokens[b, n:] == PAD) and np.all(gen.logprobs[b, n:] == 0)
        assert np.all(gen.entropies[b, n:] == 0)
    assert gen.lengths[0] <= 3 and gen.finished[0]
    assert jnp.issubdtype(gen.tokens.dtype, jnp.integer) and gen.values.shape == (3,)


MARKERS = (61,)   # a stand-in for <sep>: the ids before it are the labels on offer
CHOICE_PROMPTS = [[1, 60, 5, 21, 61, 6, 22, 61, 7, 23, 61], [1, 60, 9, 30, 61, 31, 61], [1, 5, 9]]


def test_label_positions_are_exactly_the_ids_before_a_marker():
    rows = pack_rows(CHOICE_PROMPTS, length=12, pad_id=PAD, side="left")
    labels = np.asarray(label_positions(rows.tokens, rows.mask, MARKERS))
    assert [set(rows.tokens[b][labels[b]]) for b in range(3)] == [{21, 22, 23}, {30, 31}, set()]
    # A marker right after left padding makes no label of the padding.
    padded = pack_rows([[61, 5]], length=4, pad_id=PAD, side="left")
    assert not np.asarray(label_positions(padded.tokens, padded.mask, MARKERS)).any()


def test_constrained_generation_samples_offered_ids_with_the_scored_logprobs():
    rows = pack_rows(CHOICE_PROMPTS, length=12, pad_id=PAD, side="left")
    for temperature in (1.0, 0.0):
        gen = jax.tree.map(np.asarray, generate(
            GRAPHDEF, STATE, rows.tokens, rows.mask, jax.random.key(5), max_new_tokens=1,
            eoa_id=EOA, pad_id=PAD, temperature=temperature, choice_markers=MARKERS))
        assert gen.tokens[0, 0] in (21, 22, 23) and gen.tokens[1, 0] in (30, 31)
        full = pack_rows(CHOICE_PROMPTS, [row[:1] for row in gen.tokens], length=13, pad_id=PAD,
                         side="left")
        scores = jax.tree.map(np.asarray, score_rows(GRAPHDEF, STATE, full.tokens, full.mask,
                                                     1.0, choice_markers=MARKERS))
        np.testing.assert_allclose(gen.logprobs[:, 0], scores.logprobs[:, -1], rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(gen.entropies[:, 0], scores.entropies[:, -1], rtol=1e-4,
                                   atol=1e-5)
        # The offered ids carry all the probability: the entropy is at most log(#offered).
        assert gen.entropies[0, 0] <= np.log(3) + 1e-5 and gen.entropies[1, 0] <= np.log(2) + 1e-5
        assert np.all(np.isfinite(scores.logprobs)) and np.all(np.isfinite(scores.entropies))


def test_constrained_generation_needs_one_token_actions():
    rows = pack_rows(CHOICE_PROMPTS, length=12, pad_id=PAD, side="left")
    with pytest.raises(ValueError, match="max_new_tokens must be 1, got 2"):
        generate(GRAPHDEF, STATE, rows.tokens, rows.mask, jax.random.key(0), max_new_tokens=2,
                 eoa_id=EOA, pad_id=PAD, choice_markers=MARKERS)


@pytest.mark.parametrize("tokens, mask, said", [
    (ROWS.tokens[:, 1:], ROWS.mask,
     "prompt_tokens has shape (3, 7) but prompt_mask has shape (3, 8)"),
    (ROWS.tokens.astype(np.float32), ROWS.mask, "prompt_tokens has dtype float32"),
    (ROWS.tokens[0], ROWS.mask[0], "prompt_tokens has shape (8,) (rank 1)"),
    (ROWS.tokens, ROWS.mask.astype(np.float32), "prompt_mask has dtype float32"),
])
@pytest.mark.parametrize("max_new_tokens", [1, M])
def test_generate_names_prompts_of_the_wrong_shape_or_dtype(tokens, mask, said, max_new_tokens):
    with pytest.raises((ValueError, TypeError), match=re.escape(f"generate: {said}")):
        generate(GRAPHDEF, STATE, tokens, mask, jax.random.key(0), max_new_tokens=max_new_tokens,
                 eoa_id=EOA, pad_id=PAD)


def test_one_token_generation_equals_the_first_token_of_cached_generation():
    for temperature in (1.0, 0.0):
        longer = _generate(jax.random.key(7), temperature, eoa_id=NEVER)
        one = jax.tree.map(np.asarray, generate(
            GRAPHDEF, STATE, ROWS.tokens, ROWS.mask, jax.random.key(7), max_new_tokens=1,
            eoa_id=EOA, pad_id=PAD, temperature=temperature))
        np.testing.assert_array_equal(one.tokens[:, 0], longer.tokens[:, 0])
        np.testing.assert_allclose(one.logprobs[:, 0], longer.logprobs[:, 0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(one.entropies[:, 0], longer.entropies[:, 0], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(one.values, longer.values, atol=1e-6)
        np.testing.assert_array_equal(one.lengths, 1)
        np.testing.assert_array_equal(one.finished, one.tokens[:, 0] == EOA)
