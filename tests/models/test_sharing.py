"""Rows sharing a context are computed once: the kinds found, and outputs and gradients
equal to every row run on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stepcredit.models.generate import generate
from stepcredit.models import sharing
from stepcredit.models.sharing import (MIN_SHARED_ROWS, ROW_QUANTUM, pass_rows, prefill_passes,
                                       shared_prompts, shared_rows)
from stepcredit.models.tokenizer import MAX_CHOICES
from stepcredit.models.transformer import (
    TransformerConfig,
    TransformerPolicy,
    forward,
    label_slots,
    pack_rows,
    prompt_values,
    score_actions,
)

V, SEP, EOA, PAD = 80, 3, 2, 0
LABELS = (10, 11, 12, 13)
CONFIG = TransformerConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=2, mlp_dim=64)


def _policy():
    model = TransformerPolicy(CONFIG, rngs=nnx.Rngs(5))
    head = model.value_head.kernel  # zero at initialisation: give the values something to say
    head[...] = jax.random.normal(jax.random.key(6), head[...].shape)
    return model


GRAPHDEF, STATE = nnx.split(_policy())


def _listing(words):
    """A prompt offering LABELS after some words: `words <adm> a <10> <sep> b <11> <sep> ...`."""
    return list(words) + [4] + [i for k, label in enumerate(LABELS) for i in (40 + k, label, SEP)]


PROMPTS = [_listing([1, 20 + k]) for k in range(3)] + [_listing([1, 30, 31])]


def _rows(kinds, actions):
    """One row per (prompt kind, action ids), right-padded."""
    return pack_rows([PROMPTS[k] for k in kinds], actions, length=24, pad_id=PAD)


def _as_jax(shared):
    return jax.tree.map(jnp.asarray, shared)


def test_rows_equal_but_for_their_last_action_token_are_one_kind():
    kinds = [0, 0, 1, 0, 2, 1, 0, 3, 3, 2]
    rows = _rows(kinds, [[LABELS[i % 4]] for i in range(len(kinds))])
    shared = shared_rows(rows.tokens, rows.mask, rows.action_mask, markers=(SEP,))
    assert len(shared.unique) == MIN_SHARED_ROWS
    assert np.array_equal(shared.inverse[[0, 1, 3, 6]], [shared.inverse[0]] * 4)
    assert len(set(shared.inverse.tolist())) == 4
    for b, kind in enumerate(kinds):
        source = shared.unique[shared.inverse[b]]
        assert kinds[source] == kind


def test_rows_whose_actions_differ_before_the_last_token_or_sit_elsewhere_are_kinds_apart():
    prompt = PROMPTS[0]
    rows = pack_rows([prompt, prompt, prompt, prompt[:-1]] * 4,
                     [[7, 8], [7, 9], [6, 8], [SEP, 7, 8]] * 4, length=24, pad_id=PAD)
    inverse = shared_rows(rows.tokens, rows.mask, rows.action_mask).inverse
    assert inverse[0] == inverse[1]
    # Same tokens as row 0 from a shorter prompt: its action starts a column earlier.
    assert len({inverse[0], inverse[2], inverse[3]}) == 3


def test_a_last_action_token_that_is_a_marker_is_part_of_the_context():
    rows = pack_rows([PROMPTS[0]] * 16, [[SEP], [5]] * 8, length=24, pad_id=PAD)
    assert len(set(shared_rows(rows.tokens, rows.mask, rows.action_mask).inverse)) == 1
    assert len(set(shared_rows(rows.tokens, rows.mask, rows.action_mask,
                               markers=(SEP,)).inverse)) == 2


@pytest.mark.parametrize("batch, kinds, expected", [(64, 5, 8), (64, 9, 16), (64, 33, 64),
                                                    (6, 2, 6), (48, 30, 32), (48, 40, 48)])
def test_the_shared_rows_are_a_power_of_two_at_most_the_batch(batch, kinds, expected):
    rows = _rows([0] * batch, [[50 + k % 3] for k in range(batch)])
    tokens = rows.tokens.copy()
    tokens[:, 0] = np.arange(batch) % kinds  # the kind sits in the first column
    shared = shared_rows(tokens, rows.mask, rows.action_mask)
    assert len(shared.unique) == expected
    if expected == batch:  # no saving: every row is its own kind
        assert np.array_equal(shared.unique, np.arange(batch))
        assert np.array_equal(shared.inverse, np.arange(batch))
    else:
        assert len(set(shared.inverse.tolist())) == kinds


def test_shared_rows_refuses_mismatched_shapes():
    rows = _rows([0, 1], [[LABELS[0]], [LABELS[1]]])
    with pytest.raises(ValueError, match=r"shared_rows: tokens \(2, 24\), mask \(2, 23\)"):
        shared_rows(rows.tokens, rows.mask[:, :-1], rows.action_mask)


@pytest.mark.parametrize("markers, actions", [((SEP,), "labels"), ((), "text")])
def test_shared_scores_and_gradients_equal_every_row_run_alone(markers, actions):
    rng = np.random.default_rng(0)
    kinds = [0, 0, 0, 1, 1, 2, 0, 3, 3, 3, 1, 2]
    ids = ([[LABELS[i]] for i in rng.integers(0, 4, len(kinds))] if actions == "labels" else
           [[30, 50 + int(j), EOA] for j in rng.integers(0, 2, len(kinds))])
    rows = _rows(kinds, ids)
    width = max(len(a) for a in ids)
    shared = _as_jax(shared_rows(rows.tokens, rows.mask, rows.action_mask, markers=markers))
    assert len(set(np.asarray(shared.inverse).tolist())) < len(kinds)
    weights = jnp.asarray(rng.normal(size=rows.tokens.shape), jnp.float32)

    def scores(state, shared):
        return score_actions(GRAPHDEF, state, rows.tokens, rows.mask, rows.action_mask, 1.0,
                             width=width, choice_markers=markers, shared=shared)

    def objective(state, shared):
        out = scores(state, shared)
        return jnp.sum(weights * (out.logprobs + out.entropies + out.values))

    alone, together = scores(STATE, None), scores(STATE, shared)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    grads_alone = jax.grad(objective)(STATE, None)
    grads_together = jax.grad(objective)(STATE, shared)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads_alone))
    for a, b in zip(jax.tree.leaves(grads_alone), jax.tree.leaves(grads_together)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("max_new_tokens, markers", [(1, (SEP,)), (1, ()), (4, ())])
def test_generation_from_shared_prompts_samples_what_every_row_alone_samples(max_new_tokens,
                                                                             markers):
    kinds = [0, 1, 0, 0, 2, 1, 3, 0, 0, 2, 3, 0]
    prompts = pack_rows([PROMPTS[k] for k in kinds], length=20, pad_id=PAD, side="left")
    shared = shared_prompts(prompts.tokens, prompts.mask)
    assert len(shared.unique) == MIN_SHARED_ROWS and len(set(shared.inverse.tolist())) == 4

    def sample(shared):
        return jax.tree.map(np.asarray, generate(
            GRAPHDEF, STATE, prompts.tokens, prompts.mask, jax.random.key(3),
            max_new_tokens=max_new_tokens, eoa_id=EOA, pad_id=PAD, choice_markers=markers,
            shared=shared))

    alone, together = sample(None), sample(_as_jax(shared))
    np.testing.assert_array_equal(together.tokens, alone.tokens)
    np.testing.assert_array_equal(together.lengths, alone.lengths)
    for name in ("logprobs", "entropies", "values"):
        np.testing.assert_allclose(getattr(together, name), getattr(alone, name), rtol=1e-5,
                                   atol=1e-6)
    # Rows of one prompt still draw their own actions.
    assert len({tuple(alone.tokens[b]) for b, k in enumerate(kinds) if k == 0}) > 1


def _long(prompt, length):
    """`prompt` after filler words, `length` tokens in all."""
    return [1] + [50 + k % 20 for k in range(length - len(prompt))] + prompt[1:]


# 32 short prompts (30 of them distinct) beside three long ones, in a batch 256 wide.
MIXED = [PROMPTS[k % 4] + [20 + k] for k in range(30)] + [PROMPTS[0] + [20], PROMPTS[1] + [21]] + [
    _long(PROMPTS[k], 200 + 10 * k) for k in range(3)]


def test_prefill_passes_run_the_short_prompts_at_fewer_columns():
    prompts = pack_rows(MIXED, length=256, pad_id=PAD, side="left")
    shared = shared_prompts(prompts.tokens, prompts.mask)
    passes, inverse = prefill_passes(prompts.mask, shared)
    assert [(len(p.rows), p.width) for p in passes] == [(32, 64), (MIN_SHARED_ROWS, 256)]
    rows = np.concatenate([p.rows for p in passes])
    widths = np.concatenate([np.full(len(p.rows), p.width) for p in passes])
    for b in range(len(MIXED)):
        source = rows[inverse[b]]  # the row whose outputs row b reads: the same prompt
        np.testing.assert_array_equal(prompts.tokens[source], prompts.tokens[b])
        assert not prompts.mask[b, :256 - widths[inverse[b]]].any()
    # Prompts of about one length keep the one pass of the kinds, at the full width.
    even = pack_rows(PROMPTS * 4, length=256, pad_id=PAD, side="left")
    shared = shared_prompts(even.tokens, even.mask)
    (whole,), inverse = prefill_passes(even.mask, shared)
    assert whole.width == 256
    np.testing.assert_array_equal(whole.rows, shared.unique)
    np.testing.assert_array_equal(inverse, shared.inverse)


@pytest.mark.parametrize("count, rows", [(1, MIN_SHARED_ROWS), (9, 16), (64, 64), (65, 128),
                                         (700, 704), (1000, 1000)])
def test_a_pass_runs_a_power_of_two_rows_then_multiples_of_the_row_quantum(count, rows):
    assert ROW_QUANTUM == 64
    assert pass_rows(count, 1000) == rows


@pytest.mark.parametrize("markers", [(SEP,), ()])
def test_generation_split_by_width_samples_what_one_pass_samples(markers, monkeypatch):
    prompts = pack_rows(MIXED, length=256, pad_id=PAD, side="left")
    shared = shared_prompts(prompts.tokens, prompts.mask)
    assert len(prefill_passes(prompts.mask, shared)[0]) == 2

    def sample():
        return jax.tree.map(np.asarray, generate(
            GRAPHDEF, STATE, prompts.tokens, prompts.mask, jax.random.key(4), max_new_tokens=1,
            eoa_id=EOA, pad_id=PAD, choice_markers=markers, shared=shared))

    split = sample()
    monkeypatch.setattr(sharing, "SPLIT_SAVING", 1.0)  # no split saves all the work
    assert len(prefill_passes(prompts.mask, shared)[0]) == 1
    whole = sample()
    np.testing.assert_array_equal(split.tokens, whole.tokens)
    for name in ("logprobs", "entropies", "values"):
        np.testing.assert_allclose(getattr(split, name), getattr(whole, name), rtol=1e-5,
                                   atol=1e-6)


def test_prompt_values_equal_the_full_forward_pass_at_the_last_column():
    kinds = [0, 1, 0, 0, 2, 1, 3, 0, 0, 2, 3, 0]
    prompts = pack_rows([PROMPTS[k] for k in kinds], length=20, pad_id=PAD, side="left")
    _, values = forward(GRAPHDEF, STATE, prompts.tokens, prompts.mask)
    shared = _as_jax(shared_prompts(prompts.tokens, prompts.mask))
    assert np.abs(np.asarray(values[:, -1])).min() > 1e-3
    for run in (None, shared):
        np.testing.assert_allclose(
            np.asarray(prompt_values(GRAPHDEF, STATE, prompts.tokens, prompts.mask, run)),
            np.asarray(values[:, -1]), rtol=1e-5, atol=1e-6)


def test_label_slots_cover_the_most_labels_of_a_row():
    many = [1] + [i for k in range(20) for i in (40, 14 + k, SEP)]
    rows = pack_rows([PROMPTS[0], PROMPTS[1]], length=70, pad_id=PAD)
    assert label_slots(rows.tokens, rows.mask, (SEP,)) == 16  # 4 labels, the floor
    rows = pack_rows([PROMPTS[0], many], length=70, pad_id=PAD)
    assert label_slots(rows.tokens, rows.mask, (SEP,)) == 32  # 20 labels
    assert label_slots(rows.tokens, rows.mask, (99,)) == 16  # no labels at all


def test_scores_with_tight_label_slots_equal_those_with_every_slot():
    kinds = [0, 1, 2, 3, 0, 1]
    rows = _rows(kinds, [[LABELS[k]] for k in kinds])
    slots = label_slots(rows.tokens, rows.mask, (SEP,))
    assert slots < MAX_CHOICES

    def scores(label_slots):
        return score_actions(GRAPHDEF, STATE, rows.tokens, rows.mask, rows.action_mask, 1.0,
                             width=1, choice_markers=(SEP,), label_slots=label_slots)

    for a, b in zip(scores(None), scores(slots)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
