"""The transformer policy: shapes, causality, padding, value alignment, roles, rows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stepcredit.models import transformer
from stepcredit.models.transformer import (
    TransformerConfig,
    TransformerPolicy,
    count_params,
    forward,
    pack_rows,
    score_actions,
    score_rows,
    token_logprobs_and_entropy,
)

V, B, L = 64, 3, 10
CONFIG = TransformerConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=2, mlp_dim=64)


def _model_with_value_head(seed=0):
    """A tiny policy whose value head is random (it is zero-initialised)."""
    model = TransformerPolicy(CONFIG, rngs=nnx.Rngs(seed))
    head = model.value_head.kernel
    head[...] = jax.random.normal(jax.random.key(seed + 100), head[...].shape)
    return model


MODEL = _model_with_value_head()
GRAPHDEF, STATE = nnx.split(MODEL)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, V, (B, L)), jnp.int32)
FULL = jnp.ones((B, L), bool)


def test_output_shapes_and_value_head():
    logits, values = forward(GRAPHDEF, STATE, TOKENS, FULL)
    assert logits.shape == (B, L, V) and logits.dtype == jnp.float32
    assert values.shape == (B, L)
    assert jnp.all(jnp.isfinite(logits)) and float(jnp.std(values)) > 0


def test_causal_masking():
    logits, values = forward(GRAPHDEF, STATE, TOKENS, FULL)
    changed = TOKENS.at[:, 6].set((TOKENS[:, 6] + 1) % V)
    logits2, values2 = forward(GRAPHDEF, STATE, changed, FULL)
    np.testing.assert_allclose(logits2[:, :6], logits[:, :6], atol=1e-5)
    np.testing.assert_allclose(values2[:, :6], values[:, :6], atol=1e-5)
    assert float(jnp.max(jnp.abs(logits2[:, 6:] - logits[:, 6:]))) > 1e-3


def test_left_and_right_padding_give_the_same_outputs_on_real_tokens():
    lengths = [10, 7, 4]
    seqs = [np.asarray(TOKENS[b, :n]) for b, n in enumerate(lengths)]
    right = pack_rows(seqs, length=L, pad_id=0, side="right")
    left = pack_rows(seqs, length=L, pad_id=0, side="left")
    logits_r, values_r = forward(GRAPHDEF, STATE, right.tokens, right.mask)
    logits_l, values_l = forward(GRAPHDEF, STATE, left.tokens, left.mask)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits_l[b, L - n:], logits_r[b, :n], atol=1e-4)
        np.testing.assert_allclose(values_l[b, L - n:], values_r[b, :n], atol=1e-4)
    np.testing.assert_allclose(logits_r[0], forward(GRAPHDEF, STATE, TOKENS, FULL)[0][0],
                               atol=1e-5)


def test_token_logprobs_and_entropy_match_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, (2, 5))
    mask = rng.random((2, 5)) < 0.7
    logp, entropy = token_logprobs_and_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                               jnp.asarray(mask))
    z = logits - logits.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ref_logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    ref_entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    np.testing.assert_allclose(logp, np.where(mask, ref_logp, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(entropy, np.where(mask, ref_entropy, 0), rtol=1e-5, atol=1e-6)


def test_score_rows_aligns_logprobs_and_values_with_the_token_they_belong_to():
    rows = pack_rows([[5, 6, 7, 8], [9, 10], [3, 4, 5, 6, 7, 8]], [[11, 12, 2], [13, 2], [2]],
                     length=L, pad_id=0, side="left")
    scores = score_rows(GRAPHDEF, STATE, rows.tokens, rows.mask, 1.0)
    scores = jax.tree.map(np.asarray, scores)
    logits, values = forward(GRAPHDEF, STATE, rows.tokens, rows.mask)
    logp_all, values = np.asarray(jax.nn.log_softmax(logits, -1)), np.asarray(values)
    for b in range(B):
        cols = np.flatnonzero(rows.action_mask[b])
        for n in cols:   # token n is predicted at n - 1; its value is the critic at n - 1
            np.testing.assert_allclose(scores.logprobs[b, n],
                                       logp_all[b, n - 1, rows.tokens[b, n]], atol=1e-5)
            np.testing.assert_allclose(scores.values[b, n], values[b, n - 1], atol=1e-6)
        first_real = np.flatnonzero(rows.mask[b])[0]
        assert scores.logprobs[b, first_real] == 0 and scores.values[b, first_real] == 0
        assert np.all(scores.logprobs[b][~rows.mask[b]] == 0)


def test_scoring_names_rows_of_the_wrong_shape_or_dtype():
    rows = pack_rows(*TEXT_ROWS, length=L, pad_id=0)
    with pytest.raises(ValueError, match=re.escape("score_rows: tokens has shape (3, 10) but "
                                                   "mask has shape (3, 9)")):
        score_rows(GRAPHDEF, STATE, rows.tokens, rows.mask[:, 1:])
    with pytest.raises(TypeError, match="score_rows: tokens has dtype float32"):
        score_rows(GRAPHDEF, STATE, rows.tokens.astype(np.float32), rows.mask)
    with pytest.raises(ValueError, match=re.escape("score_actions: action_mask has shape (10,) "
                                                   "(rank 1); it must have rank 2")):
        score_actions(GRAPHDEF, STATE, rows.tokens, rows.mask, rows.action_mask[0], width=3)


SEP = 9   # a stand-in for <sep>: the ids before it label admissible actions
TEXT_ROWS = ([[5, 6, 7, 8], [9, 10], [3, 4, 5, 6, 7, 8]], [[11, 12, 2], [13, 2], [2]])
# The last row offers no labels, so it keeps the language-model head.
CHOICE_ROWS = ([[5, 20, SEP, 6, 21, SEP, 4], [7, 22, SEP, 4], [3, 4, 5, 6]], [[21], [22], [4]])


@pytest.mark.parametrize("side,markers,prompts_actions", [("right", (), TEXT_ROWS),
                                                          ("left", (), TEXT_ROWS),
                                                          ("right", (SEP,), CHOICE_ROWS),
                                                          ("left", (SEP,), CHOICE_ROWS)])
def test_score_actions_equals_score_rows_at_the_action_tokens(side, markers, prompts_actions):
    rows = pack_rows(*prompts_actions, length=L, pad_id=0, side=side)
    full = jax.tree.map(np.asarray, score_rows(GRAPHDEF, STATE, rows.tokens, rows.mask, 0.7,
                                               choice_markers=markers))
    fast = jax.tree.map(np.asarray, score_actions(GRAPHDEF, STATE, rows.tokens, rows.mask,
                                                  rows.action_mask, 0.7, width=3,
                                                  choice_markers=markers))
    actions = rows.action_mask
    np.testing.assert_allclose(fast.logprobs[actions], full.logprobs[actions], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fast.entropies[actions], full.entropies[actions], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(fast.values[actions], full.values[actions], atol=1e-6)
    assert not np.allclose(fast.values[actions], 0)
    for scores in (fast.logprobs, fast.entropies, fast.values):
        assert np.all(scores[~actions] == 0)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_hidden_at_equals_hidden_gathered_at_the_columns(num_layers):
    config = TransformerConfig(vocab_size=V, d_model=32, num_layers=num_layers, num_heads=2,
                               mlp_dim=64)
    model = TransformerPolicy(config, rngs=nnx.Rngs(3))
    model.value_head.kernel[...] = jax.random.normal(jax.random.key(4), (32, 1))
    rows = pack_rows([[5, 6, 7, 8], [9, 10], [3, 4, 5, 6, 7, 8]], length=L, pad_id=0, side="left")
    columns = jnp.asarray([[6, 9], [8, 9], [4, 7]])
    hidden, values = model.hidden(rows.tokens, rows.mask)
    at_hidden, at_values = model.hidden_at(rows.tokens, rows.mask, columns)
    assert at_hidden.shape == (B, 2, 32) and at_values.shape == (B, 2)
    np.testing.assert_allclose(at_hidden, jnp.take_along_axis(hidden, columns[..., None], 1),
                               atol=1e-5)
    np.testing.assert_allclose(at_values, jnp.take_along_axis(values, columns, 1), atol=1e-5)


def _numpy_attention(q, k, v, allowed):
    """Softmax attention in float64 NumPy: `[B, H, L, Dh]` queries over `[B, H, S, Dh]`."""
    scores = np.einsum("bhld,bhsd->bhls", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(allowed[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhls,bhsd->bhld", weights / weights.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("side", ["left", "right"])
def test_blocked_causal_attention_equals_softmax_attention_on_real_queries(side):
    # Rows of two blocks and 22 columns cross two block boundaries and end in a partial block.
    length, heads = 2 * transformer.ATTENTION_BLOCK + 22, 2
    lengths = [length, 100, 63, 1]
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(len(lengths), heads, length, 8)).astype(np.float32)
               for _ in range(3))
    mask = pack_rows([[1] * n for n in lengths], length=length, pad_id=0, side=side).mask
    allowed = np.asarray(transformer._causal_mask(mask))
    real = np.asarray(mask, bool)
    blocked = transformer._causal_attention(q, k, v, jnp.asarray(allowed))
    np.testing.assert_allclose(np.asarray(blocked).transpose(0, 2, 1, 3)[real],
                               _numpy_attention(q, k, v, allowed).transpose(0, 2, 1, 3)[real],
                               atol=2e-5)
    assert np.all(np.isfinite(np.asarray(blocked)))

    def dense(q, k, v):  # one softmax over every column, as jax.nn.softmax computes it
        scores = jnp.einsum("bhld,bhsd->bhls", q, k) / np.sqrt(q.shape[-1])
        scores = jnp.where(allowed[:, None], scores, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bhls,bhsd->bhld", jax.nn.softmax(scores, axis=-1), v)

    weights = jnp.asarray(rng.normal(size=blocked.shape), jnp.float32) * real[:, None, :, None]
    grads = [jax.grad(lambda *qkv: jnp.sum(fn(*qkv) * weights), argnums=(0, 1, 2))(q, k, v)
             for fn in (lambda *qkv: transformer._causal_attention(*qkv, jnp.asarray(allowed)),
                        dense)]
    for blocked_grad, dense_grad in zip(*grads):
        np.testing.assert_allclose(blocked_grad, dense_grad, atol=2e-5)


def test_long_rows_stay_causal_and_padding_free_across_attention_blocks():
    length = 3 * transformer.ATTENTION_BLOCK
    rng = np.random.default_rng(6)
    seqs = [rng.integers(1, V, n) for n in (length, 130, 70)]
    right = pack_rows(seqs, length=length, pad_id=0, side="right")
    left = pack_rows(seqs, length=length, pad_id=0, side="left")
    logits_r, values_r = forward(GRAPHDEF, STATE, right.tokens, right.mask)
    logits_l, values_l = forward(GRAPHDEF, STATE, left.tokens, left.mask)
    for b, seq in enumerate(seqs):
        n = len(seq)
        np.testing.assert_allclose(logits_l[b, length - n:], logits_r[b, :n], atol=1e-4)
        np.testing.assert_allclose(values_l[b, length - n:], values_r[b, :n], atol=1e-4)
    column = transformer.ATTENTION_BLOCK + 10
    changed = jnp.asarray(right.tokens).at[:, column].set((right.tokens[:, column] + 1) % V)
    logits_c, _ = forward(GRAPHDEF, STATE, changed, right.mask)
    np.testing.assert_allclose(logits_c[:, :column], logits_r[:, :column], atol=1e-5)
    assert float(jnp.max(jnp.abs(logits_c[0, column:] - logits_r[0, column:]))) > 1e-3


def _project(layer, h):
    """A linear layer applied in NumPy."""
    return h @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])


def test_choice_logits_point_at_each_label_with_the_scaled_query_key_product():
    model = _model_with_value_head()
    for layer in (model.choice_query, model.choice_key):   # sharpen the near-uniform start
        layer.kernel[...] = layer.kernel[...] * 50
    prompts, _ = CHOICE_ROWS
    rows = pack_rows(prompts, length=L, pad_id=0, side="left")
    columns = jnp.asarray([[L - 1], [L - 1], [L - 1]])
    logits, values = model.choice_logits(rows.tokens, rows.mask, columns, (SEP,))
    hidden, all_values = map(np.asarray, model.hidden(rows.tokens, rows.mask))
    for b in range(2):
        query = _project(model.choice_query, hidden[b, L - 1])
        labels = [n for n in range(L - 1) if rows.mask[b, n] and rows.tokens[b, n + 1] == SEP]
        expected = {int(rows.tokens[b, n]): query @ _project(model.choice_key, hidden[b, n])
                    / np.sqrt(32) for n in labels}
        assert sorted(expected) == sorted(set(prompts[b]) & {20, 21, 22}) and len(expected) >= 1
        got = np.asarray(logits[b, 0])
        for label_id, logit in expected.items():
            np.testing.assert_allclose(got[label_id], logit, rtol=1e-4, atol=1e-4)
        others = np.setdiff1d(np.arange(V), list(expected))
        assert np.all(got[others] <= -1e8)
    assert abs(float(logits[0, 0, 20] - logits[0, 0, 21])) > 1e-3   # the labels score apart
    # No labels: the language-model head, unconstrained.
    np.testing.assert_allclose(logits[2, 0], np.asarray(model.logits(hidden[2, L - 1])), atol=1e-4)
    np.testing.assert_allclose(values[:, 0], all_values[:, L - 1], atol=1e-5)


def test_policy_prm_and_reference_have_separate_parameters():
    prm = nnx.clone(MODEL)
    reference = nnx.clone(MODEL)
    _, prm_state = nnx.split(prm)
    np.testing.assert_array_equal(forward(GRAPHDEF, prm_state, TOKENS, FULL)[0],
                                  forward(GRAPHDEF, STATE, TOKENS, FULL)[0])
    prm.embed.embedding[...] += 1.0
    assert not np.allclose(prm.embed.embedding[...], reference.embed.embedding[...])
    np.testing.assert_array_equal(reference.embed.embedding[...], MODEL.embed.embedding[...])
    other = TransformerPolicy(CONFIG, rngs=nnx.Rngs(7))
    assert not np.allclose(other.embed.embedding[...], MODEL.embed.embedding[...])


def test_gradients_flow_through_split_state():
    def loss(state):
        scores = score_rows(GRAPHDEF, state, TOKENS, FULL, 1.0)
        return -jnp.mean(scores.logprobs) + jnp.mean(scores.values ** 2)

    grads = jax.jit(jax.grad(loss))(STATE)
    norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
    assert len(norms) == len(jax.tree.leaves(STATE)) and all(np.isfinite(norms))
    assert float(jnp.linalg.norm(grads["value_head"]["kernel"][...])) > 0


def test_default_config_parameter_count():
    config = TransformerConfig(vocab_size=2000)
    model = nnx.eval_shape(lambda: TransformerPolicy(config, rngs=nnx.Rngs(0)))
    per_block = 2 * 2 * 256 + (256 * 768 + 768) + (256 * 256 + 256) + (256 * 1024 + 1024) \
        + (1024 * 256 + 256)
    pointer = 2 * (256 * 256 + 256)
    expected = 2000 * 256 + 2 * per_block + 2 * 256 + 257 + pointer
    assert count_params(model) == expected == 2_223_873
    untied = nnx.eval_shape(lambda: TransformerPolicy(
        TransformerConfig(vocab_size=2000, tie_embeddings=False), rngs=nnx.Rngs(0)))
    assert count_params(untied) == 2_223_873 + 2000 * 256


def test_pack_rows_and_config_errors():
    rows = pack_rows([[1, 2], [3]], [[4, 5], []], length=5, pad_id=0, side="right")
    np.testing.assert_array_equal(rows.tokens, [[1, 2, 4, 5, 0], [3, 0, 0, 0, 0]])
    np.testing.assert_array_equal(rows.action_mask, [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    left = pack_rows([[1, 2], [3]], [[4, 5], []], length=5, pad_id=0, side="left")
    np.testing.assert_array_equal(left.tokens, [[0, 1, 2, 4, 5], [0, 0, 0, 0, 3]])
    np.testing.assert_array_equal(left.mask, [[0, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    with pytest.raises(ValueError, match="row 0 has 2 prompt \\+ 2 action tokens = 4 > length 3"):
        pack_rows([[1, 2]], [[3, 4]], length=3, pad_id=0)
    with pytest.raises(ValueError, match="side must be"):
        pack_rows([[1]], length=3, pad_id=0, side="middle")
    with pytest.raises(ValueError, match="must be an even integer"):
        TransformerConfig(vocab_size=10, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        TransformerConfig(vocab_size=10, num_layers=0)
