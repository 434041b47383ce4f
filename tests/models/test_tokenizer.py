"""The word-level tokenizer: exact round-trips, unknown words, ids, JSON."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepcredit.models.tokenizer import (
    MAX_CHOICES,
    SPECIAL_TOKENS,
    Tokenizer,
    WordTokenizer,
    count_unknown,
    split_words,
)

WORDS = ["you", "are", "in", "the", "middle", "of", "a", "room", "search", "click", "buy",
         "now", "red", "shoes", "t", "shirt", "price", "go", "to", "cabinet", "i", "answer",
         "put", "mug", "on", "desk", "finish", "back", "next", "item", "b07xk9", "12", "or",
         "and", "space", "obs", "eoa"]
TOK = WordTokenizer.from_vocabularies(WORDS[:20], WORDS[20:])

COVERED_TEXTS = [
    "search[red shoes]",
    "click[buy now]",
    "click [ Buy Now ]",
    "Price: $12.99, or $7.50!",
    "You are in the middle of a room. Go to cabinet 12.",
    "put a T-shirt on desk 3\nanswer[I ...]",
    "  a  space,\tand\r\n or a space ",
    "ITEM B07XK9: (red) {shoes} <room> \"mug\" 'a' #1 @2 ~3 `4` ^5 |6 \\7 /8 %9 &0 *+=_;?",
    "",
]


@pytest.mark.parametrize("text", COVERED_TEXTS)
def test_round_trip_is_exact_on_brackets_punctuation_digits_and_prices(text):
    ids = TOK.encode(text, on_unknown="raise")
    assert TOK.unknown_words(text) == []
    assert TOK.decode(ids) == text
    assert all(0 <= i < TOK.vocab_size for i in ids)


def test_splitting_rule_and_space_folding():
    assert split_words("Buy $12.99 now") == ["Buy", "$", "1", "2", ".", "9", "9", "now"]
    tokens = [TOK.id_to_token(i) for i in TOK.encode("search[red shoes]")]
    assert tokens == ["search", "[", "red", " shoes", "]"]
    tokens = [TOK.id_to_token(i) for i in TOK.encode("You  OK")]
    assert tokens[:2] == ["<cap>", "you"] and tokens[2] == " "


def _case(word, style):
    return {"lower": word, "cap": word.capitalize(), "upper": word.upper()}[style]


piece = st.one_of(
    st.tuples(st.sampled_from(WORDS), st.sampled_from(["lower", "cap", "upper"])).map(
        lambda ws: _case(*ws)),
    st.sampled_from(list("0123456789[](){}.,;:!?$%-'\"/")),
)
separator = st.sampled_from(["", " ", " ", " ", "  ", "\n", " \n", "\t"])


@given(st.lists(st.tuples(separator, piece), max_size=25))
def test_round_trip_property_over_generated_sentences(parts):
    text = "".join(sep + p for sep, p in parts)
    assert TOK.unknown_words(text) == []
    assert TOK.decode(TOK.encode(text)) == text


def test_unknown_words_map_to_unk_and_are_reported():
    text = "search[Blue suede shoes] WebShop"
    ids = TOK.encode(text)
    assert TOK.unknown_words(text) == ["Blue", "suede", "WebShop"]
    assert count_unknown(TOK, ids) == 3
    assert TOK.decode(ids) == "search[<unk> <unk> shoes] <unk>"
    with pytest.raises(ValueError, match=r"uncovered piece\(s\) \['Blue', 'WebShop', 'suede'\]"):
        TOK.encode(text, on_unknown="raise")


def test_text_never_encodes_to_special_ids():
    ids = TOK.encode("<obs> <eoa>", on_unknown="raise")
    assert min(ids) >= len(SPECIAL_TOKENS)
    assert TOK.decode(ids) == "<obs> <eoa>"


def test_decode_of_special_ids_and_skip_special():
    sp = TOK.special
    ids = [sp.bos, sp.task] + TOK.encode("go to desk") + [sp.act] + TOK.encode("click") + [sp.eoa]
    assert TOK.decode(ids) == "<bos><task>go to desk<act>click<eoa>"
    assert TOK.decode(ids, skip_special=True) == "go to deskclick"
    with pytest.raises(ValueError, match="out of range"):
        TOK.decode([TOK.vocab_size])


def test_ids_are_deterministic_and_json_round_trips(tmp_path):
    again = WordTokenizer.from_vocabularies(reversed(WORDS), ["red", "red"])
    assert again == TOK and again.tokens == TOK.tokens
    path = tmp_path / "tok.json"
    TOK.save(path)
    loaded = WordTokenizer.load(path)
    assert loaded == TOK and loaded.special == TOK.special
    assert loaded.encode(COVERED_TEXTS[4]) == TOK.encode(COVERED_TEXTS[4])
    with pytest.raises(ValueError, match="expected format"):
        WordTokenizer.from_json('{"format": "other", "tokens": []}')


def test_special_ids_protocol_and_bad_inputs():
    assert isinstance(TOK, Tokenizer)
    sp = TOK.special
    assert sp.pad == 0 and len({sp.pad, sp.bos, sp.eoa, sp.unk, sp.task, sp.obs, sp.act,
                                sp.adm, sp.sep}) == 9
    with pytest.raises(TypeError, match="iterables of words"):
        WordTokenizer.from_vocabularies("red shoes")
    with pytest.raises(ValueError, match="on_unknown"):
        TOK.encode("red", on_unknown="ignore")


def test_choice_tokens_label_items_and_decode_to_their_numbers():
    choices = TOK.special.choices
    assert len(choices) == MAX_CHOICES and len(set(choices)) == MAX_CHOICES
    assert choices[-1] == TOK.vocab_size - 1   # last ids: the text pieces keep their ids
    assert TOK.decode([choices[0], choices[20]], skip_special=True) == "121"
    assert not set(TOK.encode("<1> <21> 21")) & set(choices)   # text never encodes to them
    assert WordTokenizer.from_json(TOK.to_json()).special.choices == choices


@pytest.mark.parametrize("env_name", ["alfworld", "webshop", "hotpotqa"])
def test_every_text_of_an_environment_round_trips_through_its_tokenizer(env_name):
    from stepcredit.envs import registry
    from stepcredit.train.build import build_tokenizer

    tokenizer = build_tokenizer(env_name)
    texts = []
    for split in registry.make(env_name).splits:
        env = registry.make(env_name, split=split, difficulty=0, seed=0)
        for task in range(4):
            observation = env.reset(task)
            while True:
                texts += [observation.task, observation.text,
                          *(observation.admissible_actions or ())]
                action = env.expert_action()
                texts.append(action)
                result = env.step(action)
                observation = result.observation
                if result.done or result.truncated:
                    texts.append(observation.text)
                    break
        env.close()
    for text in texts:
        ids = tokenizer.encode(text, on_unknown="raise")
        assert tokenizer.decode(ids) == text, text
