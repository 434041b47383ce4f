"""Step-level prompts: layout, history window, the length policy and its counts."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepcredit.models.tokenizer import WordTokenizer
from stepcredit.prompts import PromptTooLongError, build_step_prompt, prompt_metrics

TOK = WordTokenizer.from_vocabularies(
    "find a red mug and put it on the desk you see cabinet go to take open "
    "look nothing happens search click buy now step".split())
SP = TOK.special
TASK = "Find a red mug and put it on the desk."
HISTORY = [(f"You see cabinet {i}.", f"go to cabinet {i}") for i in range(1, 6)]
OBS = "You see a red mug."
ADMISSIBLE = ["take red mug", "look", "go to desk"]


def _decode(prompt):
    return TOK.decode(prompt.ids)


def test_layout_with_window_and_admissible_actions():
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY,
                               admissible_actions=ADMISSIBLE, window=2, max_tokens=512)
    assert _decode(prompt) == (
        "<bos><task>Find a red mug and put it on the desk."
        "<obs>You see cabinet 4.<act>go to cabinet 4<eoa>"
        "<obs>You see cabinet 5.<act>go to cabinet 5<eoa>"
        "<obs>You see a red mug.<adm>take red mug<sep>look<sep>go to desk<sep><act>")
    assert prompt.ids[0] == SP.bos and prompt.ids[-1] == SP.act
    assert (prompt.history_used, prompt.history_dropped, prompt.admissible_dropped,
            prompt.num_unknown) == (2, 0, False, 0)


def test_window_larger_than_history_and_zero_window():
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY[:2], window=4)
    assert prompt.history_used == 2 and "cabinet 1" in _decode(prompt)
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY, window=0)
    assert prompt.history_used == 0 and "cabinet" not in _decode(prompt)
    assert "<adm>" not in _decode(prompt)


def test_action_window_shows_earlier_actions_without_observations():
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY, window=1,
                               action_window=2, max_tokens=512)
    assert _decode(prompt) == (
        "<bos><task>Find a red mug and put it on the desk."
        "<act>go to cabinet 3<eoa><act>go to cabinet 4<eoa>"
        "<obs>You see cabinet 5.<act>go to cabinet 5<eoa>"
        "<obs>You see a red mug.<act>")
    assert (prompt.history_used, prompt.history_dropped) == (3, 0)
    # The earlier actions are older than the pairs, so they are dropped first.
    action_tokens = len(TOK.encode(HISTORY[2][1])) + 2
    tight = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY, window=1,
                              action_window=2, max_tokens=len(prompt.ids) - 1)
    assert (tight.history_used, tight.history_dropped) == (2, 1)
    assert len(tight.ids) == len(prompt.ids) - action_tokens
    assert "cabinet 3" not in _decode(tight) and "cabinet 4<eoa><obs>" in _decode(tight)
    only_actions = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY[:2],
                                     window=0, action_window=5)
    assert _decode(only_actions).count("<act>go to cabinet") == 2
    assert "<obs>You see cabinet" not in _decode(only_actions)


def _lengths():
    full = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY,
                             admissible_actions=ADMISSIBLE, window=3)
    pair = len(TOK.encode(HISTORY[-1][0])) + len(TOK.encode(HISTORY[-1][1])) + 3
    adm = len(build_step_prompt(TOK, task=TASK, observation=OBS, admissible_actions=ADMISSIBLE,
                                window=0).ids) - len(build_step_prompt(
                                    TOK, task=TASK, observation=OBS, window=0).ids)
    return len(full.ids), pair, adm


def test_oldest_history_is_dropped_first_and_counted():
    full, pair, _ = _lengths()
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY,
                               admissible_actions=ADMISSIBLE, window=3, max_tokens=full - 1)
    assert (prompt.history_used, prompt.history_dropped, prompt.admissible_dropped) == (2, 1, False)
    assert "cabinet 3" not in _decode(prompt) and "cabinet 4" in _decode(prompt)
    assert len(prompt.ids) == full - pair
    exact = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY,
                              admissible_actions=ADMISSIBLE, window=3, max_tokens=full)
    assert exact.history_dropped == 0 and len(exact.ids) == full


def test_admissible_list_is_dropped_last_and_counted():
    full, pair, adm = _lengths()
    minimal = full - 3 * pair - adm
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY,
                               admissible_actions=ADMISSIBLE, window=3, max_tokens=minimal + adm)
    assert (prompt.history_used, prompt.history_dropped, prompt.admissible_dropped) == (0, 3, False)
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, history=HISTORY,
                               admissible_actions=ADMISSIBLE, window=3, max_tokens=minimal)
    assert (prompt.history_used, prompt.history_dropped, prompt.admissible_dropped) == (0, 3, True)
    assert len(prompt.ids) == minimal and "<adm>" not in _decode(prompt)
    with pytest.raises(PromptTooLongError, match=f"minimal prompt has {minimal} tokens"):
        build_step_prompt(TOK, task=TASK, observation=OBS, max_tokens=minimal - 1)


@given(st.integers(0, 6), st.integers(0, 3), st.integers(0, 120), st.booleans())
def test_length_policy_properties(window, action_window, max_tokens, with_admissible):
    kwargs = dict(task=TASK, observation=OBS, history=HISTORY, window=window,
                  action_window=action_window,
                  admissible_actions=ADMISSIBLE if with_admissible else None)
    try:
        prompt = build_step_prompt(TOK, max_tokens=max_tokens, **kwargs)
    except PromptTooLongError:
        assert max_tokens < len(build_step_prompt(
            TOK, **{**kwargs, "window": 0, "action_window": 0, "admissible_actions": None}).ids)
        return
    assert len(prompt.ids) <= max_tokens
    assert prompt.history_used + prompt.history_dropped == min(window + action_window,
                                                               len(HISTORY))
    assert prompt.admissible_dropped <= (prompt.history_used == 0)
    larger = build_step_prompt(TOK, max_tokens=max_tokens + 40, **kwargs)
    assert larger.history_dropped <= prompt.history_dropped


def test_actions_as_sampled_ids_are_kept_exactly():
    sampled = [TOK.encode("go")[0], TOK.encode(" to")[0], TOK.encode(" ")[0],
               TOK.encode("cabinet")[0]]      # not what encode("go to  cabinet") gives
    with_eoa = build_step_prompt(TOK, task=TASK, observation=OBS,
                                 history=[("look", sampled + [SP.eoa])], window=1)
    without = build_step_prompt(TOK, task=TASK, observation=OBS, history=[("look", sampled)],
                                window=1)
    assert with_eoa.ids == without.ids
    start = with_eoa.ids.index(SP.act)
    assert with_eoa.ids[start + 1:start + 6] == sampled + [SP.eoa]
    with pytest.raises(ValueError, match="out of range"):
        build_step_prompt(TOK, task=TASK, observation=OBS, history=[("look", [TOK.vocab_size])])


def test_unknown_words_are_counted_and_metrics_aggregate():
    known = build_step_prompt(TOK, task=TASK, observation=OBS)
    unknown = build_step_prompt(TOK, task=TASK, observation="You see a golden key.",
                                history=HISTORY, window=2, max_tokens=len(known.ids) + 10)
    assert unknown.num_unknown == 2
    metrics = prompt_metrics([known, unknown])
    assert metrics["prompt/unknown_tokens"] == 2
    assert metrics["prompt/history_dropped"] == unknown.history_dropped >= 1
    assert metrics["prompt/length_max"] == max(len(known.ids), len(unknown.ids))
    assert metrics["prompt/admissible_dropped"] == 0
    for window, action_window in [(-1, 0), (0, -1)]:
        with pytest.raises(ValueError, match="window and action_window must be >= 0"):
            build_step_prompt(TOK, task=TASK, observation=OBS, window=window,
                              action_window=action_window)


def test_choice_labels_number_the_admissible_actions_with_one_token_each():
    prompt = build_step_prompt(TOK, task=TASK, observation=OBS, admissible_actions=ADMISSIBLE,
                               window=0, max_tokens=512, choice_labels=True)
    assert _decode(prompt).endswith("<adm>take red mug1<sep>look2<sep>go to desk3<sep><act>")
    before_sep = [prompt.ids[i - 1] for i, t in enumerate(prompt.ids) if t == SP.sep]
    assert before_sep == list(SP.choices[:3])
    with pytest.raises(ValueError, match="200 admissible actions but the tokenizer has 128"):
        build_step_prompt(TOK, task=TASK, observation=OBS, admissible_actions=["look"] * 200,
                          window=0, max_tokens=10_000, choice_labels=True)
