"""Fuzzing every registered estimator: never a silent NaN.

For every name in `stepcredit.advantages.names()`, random batches with random masks
(all-masked rows and batches included), NaN, inf or 1e30 in the padding (masked steps,
observation and padding tokens), singleton and all-equal groups and extreme but finite
magnitudes (1e-6, 1e6, and both in one batch, in float32) must give finite credit, 0 at
masked positions, or raise a ValueError / TypeError that names an input argument. Eagerly,
a non-finite value at a valid position must raise, naming the argument; under `jit` (no
value checks) the padding must still never reach the output.

Shapes come in two fixed buckets (eager ops compile twice at most, the compiled path once
per estimator).
"""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepcredit import advantages as adv
from stepcredit.advantages import CreditInputs
from stepcredit.batch import StepBatch, TokenBatch
from stepcredit.credit import compiled_compute_advantages, compute_advantages

# (B, T), N = 3 T + 1 (up to 2 action tokens and an observation token per step). One B, so
# the [B] group statistics compile once; tests/test_museum.py reuses (4, 3).
BUCKETS = ((4, 3), (4, 2))
NAMES = adv.names()
PADDING = (np.nan, np.inf, -np.inf, 1e30)
SCALES = (1e-6, 1.0, 1e6, "mixed")  # "mixed": magnitudes 1e-6 to 1e6 in one batch
# Float fields a caller fills, and the arguments an error may name for each.
FLOAT_FIELDS = {
    "step_rewards": ("step_rewards", "rewards", "token_rewards"),
    "step_values": ("values",),
    "entropy": ("entropy",),
    "scores": ("scores", "outcome_scores"),
    "bootstrap_value": ("bootstrap_value",),
    "token_values": ("values",),
    "prm_logp": ("prm_logp",),
    "ref_logp": ("ref_logp",),
    "base_advantages": ("advantages",),
    "mc_values": ("values",),
    "answer_logp": ("answer_logp", "information_gain"),
    "progress": ("progress",),
}
NAMED = re.compile(r"^[\w+.]+: (\w+)[ =]")


@st.composite
def batches(draw, *, bucket=None, first_step_valid=False):
    """A `(StepBatch, TokenBatch, extra)` with NaN/inf padding and a chosen magnitude.

    With `first_step_valid`, step 0 of row 0 is valid and its first action token is token 0.
    """
    batch, num_steps = draw(st.sampled_from(BUCKETS)) if bucket is None else bucket
    num_tokens = 3 * num_steps + 1
    mask = np.array(draw(st.lists(st.lists(st.booleans(), min_size=num_steps, max_size=num_steps),
                                  min_size=batch, max_size=batch)), bool)
    if draw(st.booleans()):
        mask[draw(st.integers(1 if first_step_valid else 0, batch - 1))] = False  # all masked
    mask[0, 0] |= first_step_valid
    group_ids = np.array(draw(st.one_of(
        st.lists(st.sampled_from([-3, 7, 1000]), min_size=batch, max_size=batch),
        st.just(list(range(batch))),  # every group a singleton
        st.just([0] * batch))), np.int32)
    scale = draw(st.sampled_from(SCALES))
    equal = draw(st.booleans())  # every valid entry of each field equal: all-equal groups
    pad = draw(st.sampled_from(PADDING))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    step_index = np.full((batch, num_tokens), -1, np.int32)
    for b in range(batch):
        # An observation (or prompt) token may come first.
        position = 0 if first_step_valid and b == 0 else int(rng.integers(0, 2))
        for t in range(num_steps):
            if mask[b, t]:
                width = int(rng.integers(1, 3))
                step_index[b, position:position + width] = t
                position += width + int(rng.integers(0, 2))
    action = step_index >= 0

    def field(shape, valid, *, positive=False, sign=1.0):
        values = np.full(shape, 0.5) if equal else rng.uniform(-1.0, 1.0, shape)
        values = np.abs(values) if positive else values
        magnitude = (scale if scale != "mixed"
                     else 10.0 ** rng.uniform(-6, 6, () if equal else shape))
        return np.where(valid, sign * magnitude * values, pad).astype(np.float32)

    ones = np.ones(batch, bool)
    steps = StepBatch(
        reward=field((batch, num_steps), mask), mask=mask,
        done=np.zeros((batch, num_steps), bool), truncated=np.zeros((batch, num_steps), bool),
        value=field((batch, num_steps), mask),
        entropy=field((batch, num_steps), mask, positive=True),
        logp=np.zeros((batch, num_steps), np.float32),
        anchor=np.where(mask, rng.integers(0, 2, (batch, num_steps)), -1).astype(np.int32),
        group_id=group_ids, score=field(batch, ones), bootstrap_value=field(batch, ones))
    tokens = TokenBatch(tokens=np.where(action, 5, 0).astype(np.int32), action_mask=action,
                        step_index=step_index, logp=np.zeros(action.shape, np.float32),
                        entropy=np.zeros(action.shape, np.float32))
    extra = {"token_values": field(action.shape, action),
             "prm_logp": field(action.shape, action, positive=True, sign=-1.0),
             "ref_logp": field(action.shape, action, positive=True, sign=-1.0),
             "mc_values": field((batch, num_steps), mask),
             "answer_logp": field((batch, num_steps), mask, positive=True, sign=-1.0),
             "progress": field((batch, num_steps), mask), "grounding": mask.copy()}
    if draw(st.booleans()):
        extra["base_advantages"] = field(batch, ones)
    return steps, tokens, extra


def _inputs(steps, tokens, extra):
    return CreditInputs(mask=steps.mask, step_rewards=steps.reward, step_values=steps.value,
                        bootstrap_value=steps.bootstrap_value, entropy=steps.entropy,
                        anchors=steps.anchor, group_ids=steps.group_id, scores=steps.score,
                        step_index=tokens.step_index, **extra)


ARGUMENTS = {a for names in FLOAT_FIELDS.values() for a in names} | {
    "mask", "group_ids", "anchors", "step_index", "action_mask"}


def _named(error: Exception) -> bool:
    """The error names an input argument (the `_checks` convention: "fn: argument ...")."""
    match = NAMED.match(str(error))
    return bool(match) and match.group(1) in ARGUMENTS


def _finite(name, label, out, valid=None):
    out = np.asarray(out)
    assert np.all(np.isfinite(out)), f"{name}: non-finite {label}"
    if valid is not None:
        assert np.all(out[~valid] == 0), f"{name}: {label} not 0 at masked positions"


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=6)
@given(data=batches())
def test_valid_input_gives_finite_credit_or_a_named_error(name, data):
    steps, tokens, extra = data
    entry = adv.get(name)
    try:
        if entry.output_level == "trajectory":  # [B]: compute_advantages masks empty rows
            _finite(name, "advantages", adv.apply(name, _inputs(steps, tokens, extra)).advantages)
        credit = compute_advantages(steps, tokens, name, **extra)
    except (ValueError, TypeError) as error:
        assert _named(error), f"{name}: an error that names no input: {error!r}"
        return
    action = tokens.step_index >= 0
    _finite(name, "token credit", credit.token_advantages, action)
    if credit.step_advantages is not None:  # raw (whiten "none") or whitened over valid steps
        _finite(name, "step credit", credit.step_advantages, steps.mask)
    if credit.returns is not None:
        _finite(name, "returns", credit.returns,
                steps.mask if entry.output_level == "step" else action)


@st.composite
def corrupted(draw, name):
    """A batch with one valid entry of a field `name` reads set to NaN or inf."""
    steps, tokens, extra = draw(batches(bucket=BUCKETS[0], first_step_valid=True))
    extra.pop("base_advantages", None)  # plain EMPG then reads its base estimator's fields
    field = draw(st.sampled_from(sorted(set(FLOAT_FIELDS) & adv.get(name).fields)))
    value = draw(st.sampled_from((np.nan, np.inf, -np.inf)))
    arrays = {"step_rewards": steps.reward, "step_values": steps.value, "entropy": steps.entropy,
              "scores": steps.score, "bootstrap_value": steps.bootstrap_value, **extra}
    target = arrays[field]
    target[(0, 0) if target.ndim == 2 else 0] = value
    return steps, tokens, extra, field


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4)
@given(data=st.data())
def test_non_finite_valid_input_raises_naming_the_argument(name, data):
    steps, tokens, extra, field = data.draw(corrupted(name))
    with pytest.raises(ValueError, match="is not finite") as raised:
        compute_advantages(steps, tokens, name, **extra)
    argument = NAMED.match(str(raised.value)).group(1)
    assert argument in FLOAT_FIELDS[field], (name, field, str(raised.value))


@settings(max_examples=10)
@given(data=batches(bucket=BUCKETS[0]))
def test_compiled_credit_ignores_nan_padding(data):
    """Under `jit` the value checks are skipped, so NaN and inf in the padding must not reach
    any output of any estimator (one compiled program per estimator and bucket)."""
    steps, tokens, extra = data
    extra.pop("base_advantages", None)  # one pytree structure: one program per estimator
    for name in NAMES:
        credit = compiled_compute_advantages(steps, tokens, name, **extra)
        for out in credit:
            if out is not None:
                assert np.all(np.isfinite(np.asarray(out))), name
        assert np.all(np.asarray(credit.token_advantages)[tokens.step_index < 0] == 0), name


STEPS = np.ones((2, 3), np.float32)
MASK = np.ones((2, 3), bool)
ONES = np.ones(2, np.float32)
GROUPS = np.zeros(2, np.int32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.5"])
@pytest.mark.parametrize("call, name", [
    (lambda x: adv.empg(ONES, STEPS, MASK, k=x), "empg: k"),
    (lambda x: adv.empg(ONES, STEPS, MASK, zeta=x), "empg: zeta"),
    (lambda x: adv.mt_grpo(STEPS, ONES, GROUPS, MASK, lam=x), "mt_grpo: lam"),
    (lambda x: adv.merge_process_rewards(ONES, STEPS, MASK, weight=x),
     "merge_process_rewards: weight"),
    (lambda x: adv.prime_token_rewards(STEPS, STEPS, MASK, beta=x), "prime_token_rewards: beta"),
    (lambda x: adv.istar(ONES, STEPS, GROUPS, MASK, alpha=x), "istar: alpha"),
    (lambda x: adv.spa_step_rewards(STEPS, MASK, MASK, beta=x), "spa_step_rewards: beta"),
    (lambda x: adv.discounted_returns(STEPS, MASK, gamma=x), "discounted_returns: gamma"),
])
def test_a_hyperparameter_that_is_not_a_finite_number_is_named(call, name, bad):
    """Called directly, not through the registry (which checks its own): a NaN weight gave
    every step a NaN advantage, a string failed inside JAX."""
    said = (f"{name}='0.5' is a str; it must be a number" if isinstance(bad, str)
            else f"{name}={bad}")
    with pytest.raises(ValueError, match=re.escape(said)):
        call(bad)
