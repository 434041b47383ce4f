"""An embedded multi-hop question answering task in the shape of HotpotQA with
ReAct's Wikipedia tools.

A generated knowledge base of people, cities, countries, films and companies
has one short paragraph per entity, each sentence stating one fact ("It was
directed by Ada Voss."). Questions are HotpotQA's two kinds, bridge ("where was
the director of The Silent River born?") and comparison ("who was born first,
Ada Voss or Tom Reyes?"), with 3-hop bridges at difficulty 2. The agent uses
ReAct's actions: `search[entity]` (the paragraph's first sentences, or similar
titles), `lookup[keyword]` (the next sentence of the open page containing the
keyword, as "(Result i / n) ...") and `finish[answer]`.

Reward: exact match of the normalised answer (HotpotQA's `normalize_answer`);
`info` carries `em` and `f1`, and `task_type`: the question's kind
("director_birthplace", "born_first", ...), for success per kind.

Differences from HotpotQA (arXiv 1809.09600) and ReAct (arXiv 2210.03629): the
knowledge base is generated and small, so titles are exact and paragraphs short;
a search shows all sentences at difficulty 0, two at difficulty 1 and one at
difficulty 2 (the rest need `lookup`); admissible actions are listed (searches
for the entities read so far, the lookup keywords, and finishing with an entity
or value read so far, yes or no), though any text is accepted.

Oracle: a solution reads every supporting fact (the sentences a question's
answer follows from) and then answers, so `oracle_distance` counts searches,
lookups and the final `finish`. `reference_answer()` gives the trainer the
ground-truth answer (IGPO's information gain), never shown to the agent.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import random
import string
from typing import Any

from stepcredit.envs._sim import Outcome, SimulatorEnv, task_rng
from stepcredit.envs._text import bracket_command, stable_bucket, vocabulary_of, words
from stepcredit.envs.base import Observation, step_info

BAD_FORMAT = "Invalid action: use search[entity], lookup[keyword] or finish[answer]."
NO_PAGE = "Invalid action: search for an entity before looking up a keyword."
EMPTY_ARGUMENT = "Invalid action: the argument is empty."
START_TEXT = "No page is open. Search for an entity to begin."
NO_MORE = "No more results."

_VISIBLE_SENTENCES = (100, 2, 1)  # sentences a search shows, per difficulty
LOOKUP_KEYWORDS = ("born", "citizen", "directed", "released", "filmed", "founded",
                   "headquarters", "capital", "population", "city")

_FIRST = ("ada", "tom", "lena", "omar", "iris", "hugo", "nina", "felix", "clara", "ivan", "maya",
          "otto", "rosa", "leo", "vera", "max", "elsa", "jonas", "tara", "emil", "zoe", "arne",
          "lucia", "paul", "mira", "sven", "dora", "nils", "ines", "karl")
_LAST = ("voss", "reyes", "holm", "marek", "sato", "brandt", "okafor", "lind", "varga", "costa",
         "berg", "novak", "quist", "falk", "moreau", "adler", "kovac", "strom", "petrov", "lang",
         "weiss", "aalto", "bauer", "dunn", "ekman", "frey", "gallo", "hahn", "ito", "jensen")
_CITY_PREFIX = ("port", "new", "east", "west", "north", "south", "lake", "fort", "mount", "old")
_CITY_ROOT = ("aldin", "marrow", "brenna", "castor", "dunmore", "elvain", "glenrow", "halden",
              "ismere", "jarrow", "kelvane", "lorn", "mirren", "norwick", "ostra", "pellam",
              "rosell", "stavn", "tarrin", "ulver", "varro", "wexley")
_COUNTRIES = ("arlenia", "belmora", "cestria", "dovania", "eskarra", "feronia", "galdovia",
              "halvaria", "istrelia", "jorvania", "kestovia", "lumeria")
_REGIONS = ("asteria", "borealis", "meridia", "occidia")
_LANGUAGES = ("arlen", "belic", "cestran", "dovan", "eskar", "feric")
_RIVERS = ("amber", "silver", "cold", "long", "swift", "grey", "stone", "willow")
_OCCUPATIONS = ("painter", "novelist", "physicist", "architect", "composer", "chemist",
                "sculptor", "historian", "engineer", "poet", "actor", "economist")
_FILM_ADJ = ("silent", "hidden", "broken", "golden", "last", "distant", "frozen", "burning",
             "lonely", "crimson", "endless", "quiet", "wild", "lost")
_FILM_NOUN = ("river", "garden", "mirror", "harbor", "letter", "voyage", "winter", "kingdom",
              "bridge", "tower", "promise", "stranger", "island", "signal")
_GENRES = ("drama", "comedy", "thriller", "documentary", "western", "musical", "horror",
           "romance")
_COMPANY_ROOT = ("aurex", "bexon", "calder", "dynara", "elvix", "fornax", "gravis", "helion",
                 "ionis", "juno", "kavex", "lyra", "meron", "nexa", "orin", "pavo")
_COMPANY_SUFFIX = ("industries", "systems", "labs", "motors", "foods", "media")
_INDUSTRIES = ("software", "shipping", "steel", "textile", "food", "media", "energy", "toy")

_NUM_CITIES, _NUM_PEOPLE, _NUM_FILMS, _NUM_COMPANIES = 100, 500, 196, 96

# question kind -> (template, supporting facts as (hop, relation) pairs)
_BRIDGE = {
    "director_birthplace": "where was the director of {0} born?",
    "founder_birth_year": "in what year was the founder of {0} born?",
    "director_citizenship": "which country is the director of {0} a citizen of?",
    "headquarters_country": "in which country are the headquarters of {0}?",
    "filming_country": "in which country was {0} filmed?",
    "birth_city_founded": "in what year was the city where {0} was born founded?",
}
_COMPARISON = {
    "born_first": "who was born first, {0} or {1}?",
    "released_earlier": "which film was released earlier, {0} or {1}?",
    "larger_city": "which city has a larger population, {0} or {1}?",
    "same_citizenship": "are {0} and {1} citizens of the same country?",
}
_THREE_HOP = {
    "director_birth_country": "in which country was the director of {0} born?",
    "headquarters_capital": "what is the capital of the country where {0} has its headquarters?",
    "founder_city_founded": "in what year was the city where the founder of {0} was born founded?",
}


@dataclasses.dataclass(frozen=True)
class HotpotQAConfig:
    """Configuration of `HotpotQAEnv`.

    Attributes:
      split: "train" or "test" (a stable hash of the question decides the split,
        so the two never share a question).
      difficulty: 0 (2-hop, searches show whole paragraphs), 1 (2-hop, searches
        show two sentences) or 2 (half 3-hop, searches show one sentence).
      seed: the knowledge base and task seed.
      max_steps: the step limit (8, as in the GiGPO/verl-agent search setting).
      num_train_tasks: tasks in "train".
      num_test_tasks: tasks in "test".
    """

    split: str = "train"
    difficulty: int = 1
    seed: int = 0
    max_steps: int = 8
    num_train_tasks: int = 10_000
    num_test_tasks: int = 1_000


@dataclasses.dataclass(frozen=True)
class _Entity:
    key: str
    name: str
    sentences: tuple[str, ...]
    word_sets: tuple[frozenset[str], ...]
    mentions: tuple[tuple[str, ...], ...]
    values: tuple[tuple[str, ...], ...]
    fact_index: dict[str, int]


@dataclasses.dataclass(frozen=True)
class _Question:
    text: str
    answer: str
    facts: tuple[tuple[str, int], ...]
    mentions: tuple[str, ...]
    kind: str = ""


@functools.lru_cache(maxsize=65536)
def _title(key: str) -> str:
    return string.capwords(key)


class _KnowledgeBase:
    """The entities, their paragraphs and the facts questions are built from."""

    def __init__(self, seed: int):
        rng = random.Random(f"hotpotqa/kb/{seed}")
        self.entities: dict[str, _Entity] = {}
        self.facts: dict[str, dict[str, Any]] = {}
        city_names = [f"{p} {r}" for p in _CITY_PREFIX for r in _CITY_ROOT] + list(_CITY_ROOT)
        cities = rng.sample(city_names, _NUM_CITIES)
        people = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], _NUM_PEOPLE)
        films = rng.sample([f"the {a} {n}" for a in _FILM_ADJ for n in _FILM_NOUN], _NUM_FILMS)
        companies = rng.sample([f"{r} {s}" for r in _COMPANY_ROOT for s in _COMPANY_SUFFIX],
                               _NUM_COMPANIES)
        self.cities, self.people, self.films, self.companies = cities, people, films, companies
        city_country = {c: _COUNTRIES[i % len(_COUNTRIES)] if i < len(_COUNTRIES)
                        else rng.choice(_COUNTRIES) for i, c in enumerate(cities)}
        populations = rng.sample(range(10, 1000), len(cities))
        for i, c in enumerate(cities):
            country, founded = city_country[c], rng.randint(1000, 1899)
            self._add(rng, c, f"{_title(c)} is a city in {_title(country)}.", [country], [country],
                      [("founded", f"It was founded in {founded}.", [], [str(founded)]),
                       ("population", f"It has a population of {populations[i]} thousand.", [],
                        []),
                       ("river", f"It lies on the {rng.choice(_RIVERS)} river.", [], [])],
                      country=country, population=populations[i], founded=founded)
        for country in _COUNTRIES:
            capital = next(c for c in cities if city_country[c] == country)
            self._add(rng, country, f"{_title(country)} is a country in {_title(rng.choice(_REGIONS))}.",
                      [], [],
                      [("capital", "Its capital is {}.", [capital], [capital]),
                       ("population", f"It has a population of {rng.randint(1, 99)} million.", [],
                        []),
                       ("language", f"Its official language is {_title(rng.choice(_LANGUAGES))}.",
                        [], [])],
                      capital=capital)
        for p in people:
            pron = rng.choice(("He", "She"))
            born_in, citizen = rng.choice(cities), rng.choice(_COUNTRIES)
            year = rng.randint(1900, 1995)
            self._add(rng, p, f"{_title(p)} is a {rng.choice(_OCCUPATIONS)}.", [], [],
                      [("born", f"{pron} was born in {{}} in {year}.", [born_in],
                        [born_in, str(year)]),
                       ("citizen", f"{pron} is a citizen of {{}}.", [citizen], [citizen]),
                       ("studied", f"{pron} studied at the university of {{}}.",
                        [rng.choice(cities)], [])],
                      born_in=born_in, born=year, citizen=citizen)
        for f in films:
            director, filmed, year = rng.choice(people), rng.choice(cities), rng.randint(1950, 2020)
            self._add(rng, f, f"{_title(f)} is a {rng.choice(_GENRES)} film.", [], [],
                      [("directed", "It was directed by {}.", [director], [director]),
                       ("released", f"It was released in {year}.", [], [str(year)]),
                       ("filmed", "It was filmed in {}.", [filmed], [filmed])],
                      director=director, released=year, filmed=filmed)
        for co in companies:
            founder, hq = rng.choice(people), rng.choice(cities)
            year = rng.randint(1900, 2015)
            self._add(rng, co, f"{_title(co)} is a {rng.choice(_INDUSTRIES)} company.", [], [],
                      [("founded", f"It was founded by {{}} in {year}.", [founder],
                        [founder, str(year)]),
                       ("headquarters", "Its headquarters are in {}.", [hq], [hq]),
                       ("employs", f"It employs {rng.randint(100, 9900)} people.", [], [])],
                      founder=founder, headquarters=hq)
        self.word_index: dict[str, list[str]] = collections.defaultdict(list)
        for key in self.entities:
            for w in key.split():
                self.word_index[w].append(key)

    def _add(self, rng: random.Random, key: str, intro: str, intro_mentions: list[str],
             intro_values: list[str], facts: list[tuple[str, str, list[str], list[str]]],
             **attributes: Any) -> None:
        """Adds an entity whose paragraph is the intro then the facts in a random
        order; `{}` in a fact's text is filled with its mention's title."""
        rng.shuffle(facts)
        sentences, mentions, values = [intro], [tuple(intro_mentions)], [tuple(intro_values)]
        fact_index = {"intro": 0}
        for relation, text, fact_mentions, fact_values in facts:
            fact_index[relation] = len(sentences)
            sentences.append(text.format(*map(_title, fact_mentions)))
            mentions.append(tuple(fact_mentions))
            values.append(tuple(fact_values))
        self.entities[key] = _Entity(key, _title(key), tuple(sentences),
                                     tuple(frozenset(words(s)) for s in sentences),
                                     tuple(mentions), tuple(values), fact_index)
        self.facts[key] = dict(attributes)

    def similar(self, query_words: list[str]) -> list[str]:
        """Up to five titles sharing the most words with the query."""
        counts: dict[str, int] = {}
        for w in query_words:
            for key in self.word_index.get(w, ()):
                counts[key] = counts.get(key, 0) + 1
        return sorted(counts, key=lambda k: (-counts[k], k))[:5]


@functools.lru_cache(maxsize=8)
def _kb(seed: int) -> _KnowledgeBase:
    return _KnowledgeBase(seed)


def _fact(kb: _KnowledgeBase, key: str, relation: str) -> tuple[str, int]:
    return key, kb.entities[key].fact_index[relation]


def _make_question(kb: _KnowledgeBase, rng: random.Random, kind: str) -> _Question | None:
    """One question of `kind`, or None when the draw gives a tie."""
    f, e = kb.facts, _fact
    if kind == "director_birthplace":
        film = rng.choice(kb.films)
        person = f[film]["director"]
        return _Question(_BRIDGE[kind].format(_title(film)), f[person]["born_in"],
                         (e(kb, film, "directed"), e(kb, person, "born")), (film,))
    if kind == "founder_birth_year":
        co = rng.choice(kb.companies)
        person = f[co]["founder"]
        return _Question(_BRIDGE[kind].format(_title(co)), str(f[person]["born"]),
                         (e(kb, co, "founded"), e(kb, person, "born")), (co,))
    if kind == "director_citizenship":
        film = rng.choice(kb.films)
        person = f[film]["director"]
        return _Question(_BRIDGE[kind].format(_title(film)), f[person]["citizen"],
                         (e(kb, film, "directed"), e(kb, person, "citizen")), (film,))
    if kind == "headquarters_country":
        co = rng.choice(kb.companies)
        city = f[co]["headquarters"]
        return _Question(_BRIDGE[kind].format(_title(co)), f[city]["country"],
                         (e(kb, co, "headquarters"), e(kb, city, "intro")), (co,))
    if kind == "filming_country":
        film = rng.choice(kb.films)
        city = f[film]["filmed"]
        return _Question(_BRIDGE[kind].format(_title(film)), f[city]["country"],
                         (e(kb, film, "filmed"), e(kb, city, "intro")), (film,))
    if kind == "birth_city_founded":
        person = rng.choice(kb.people)
        city = f[person]["born_in"]
        return _Question(_BRIDGE[kind].format(_title(person)), str(f[city]["founded"]),
                         (e(kb, person, "born"), e(kb, city, "founded")), (person,))
    if kind in ("born_first", "same_citizenship"):
        a, b = rng.sample(kb.people, 2)
        if kind == "born_first":
            if f[a]["born"] == f[b]["born"]:
                return None
            answer = a if f[a]["born"] < f[b]["born"] else b
            relation = "born"
        else:
            answer = "yes" if f[a]["citizen"] == f[b]["citizen"] else "no"
            relation = "citizen"
        return _Question(_COMPARISON[kind].format(_title(a), _title(b)), answer,
                         (e(kb, a, relation), e(kb, b, relation)), (a, b))
    if kind == "released_earlier":
        a, b = rng.sample(kb.films, 2)
        if f[a]["released"] == f[b]["released"]:
            return None
        return _Question(_COMPARISON[kind].format(_title(a), _title(b)),
                         a if f[a]["released"] < f[b]["released"] else b,
                         (e(kb, a, "released"), e(kb, b, "released")), (a, b))
    if kind == "larger_city":
        a, b = rng.sample(kb.cities, 2)
        return _Question(_COMPARISON[kind].format(_title(a), _title(b)),
                         a if f[a]["population"] > f[b]["population"] else b,
                         (e(kb, a, "population"), e(kb, b, "population")), (a, b))
    if kind == "director_birth_country":
        film = rng.choice(kb.films)
        person = f[film]["director"]
        city = f[person]["born_in"]
        return _Question(_THREE_HOP[kind].format(_title(film)), f[city]["country"],
                         (e(kb, film, "directed"), e(kb, person, "born"), e(kb, city, "intro")),
                         (film,))
    if kind == "headquarters_capital":
        co = rng.choice(kb.companies)
        city = f[co]["headquarters"]
        country = f[city]["country"]
        return _Question(_THREE_HOP[kind].format(_title(co)), f[country]["capital"],
                         (e(kb, co, "headquarters"), e(kb, city, "intro"),
                          e(kb, country, "capital")), (co,))
    co = rng.choice(kb.companies)
    person = f[co]["founder"]
    city = f[person]["born_in"]
    return _Question(_THREE_HOP[kind].format(_title(co)), str(f[city]["founded"]),
                     (e(kb, co, "founded"), e(kb, person, "born"), e(kb, city, "founded")), (co,))


@functools.lru_cache(maxsize=4096)
def _question(seed: int, split: str, difficulty: int, index: int) -> _Question:
    kb = _kb(seed)
    for attempt in itertools.count():
        rng = task_rng("hotpotqa", seed, split, difficulty, index, attempt)
        if difficulty == 2 and rng.random() < 0.5:
            kinds = _THREE_HOP
        else:
            kinds = _BRIDGE if rng.random() < 0.5 else _COMPARISON
        kind = rng.choice(sorted(kinds))
        question = _make_question(kb, rng, kind)
        if question is not None and (stable_bucket(question.text, 5) == 0) == (split == "test"):
            return dataclasses.replace(question, kind=kind)
    raise AssertionError("unreachable")


_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """HotpotQA's answer normalisation: lowercase, no punctuation, no articles,
    single spaces."""
    text = text.lower().translate(_NO_PUNCTUATION)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def f1_score(prediction: str, gold: str) -> float:
    """HotpotQA's token F1 between normalised answers (yes/no/noanswer must match
    exactly)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer")) and pred != ref:
        return 0.0
    common = collections.Counter(pred.split()) & collections.Counter(ref.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred.split()), same / len(ref.split())
    return 2 * precision * recall / (precision + recall)


@functools.lru_cache(maxsize=1)
def vocabulary() -> frozenset[str]:
    """The words (see `stepcredit.envs._text.words`) that HotpotQA observations,
    questions and admissible actions can contain."""
    lists = (_FIRST, _LAST, _CITY_PREFIX, _CITY_ROOT, _COUNTRIES, _REGIONS, _LANGUAGES, _RIVERS,
             _OCCUPATIONS, _FILM_ADJ, _FILM_NOUN, _GENRES, _COMPANY_ROOT, _COMPANY_SUFFIX,
             _INDUSTRIES, LOOKUP_KEYWORDS)
    texts = [" ".join(x) for x in lists]
    texts += list(_BRIDGE.values()) + list(_COMPARISON.values()) + list(_THREE_HOP.values())
    texts += [" ".join(str(i) for i in range(10_000)), BAD_FORMAT, NO_PAGE, EMPTY_ARGUMENT,
              START_TEXT, NO_MORE, "Could not find that entity. Similar: ['a', 'b'].",
              "(Result 1 / 2) Episode finished, reward = 0 search[] lookup[] finish[] yes no",
              "is a city in . It was founded in . It has a population of thousand. It lies on "
              "the river. is a country in . Its capital is . million. Its official language is "
              "is a . He She was born in in . is a citizen of . studied at the university of . "
              "film. It was directed by . It was released in . It was filmed in . company. It "
              "was founded by in . Its headquarters are in . It employs people."]
    return frozenset(vocabulary_of(texts))


class HotpotQAEnv(SimulatorEnv):
    """HotpotQA-style multi-hop QA with ReAct's tools; see the module docstring.

    Args:
      config: a `HotpotQAConfig`; keyword arguments override its fields.
    """

    name = "hotpotqa"
    splits = ("train", "test")
    # What `_start` and `_act` set or change: the state a snapshot copies.
    _episode_state = ("_question", "_page", "_keyword", "_results", "_count", "_revealed",
                      "_searches", "_answers")

    def __init__(self, config: HotpotQAConfig | None = None, **overrides: Any):
        super().__init__(dataclasses.replace(config or HotpotQAConfig(), **overrides))
        self._kb = _kb(self.config.seed)
        self._visible = _VISIBLE_SENTENCES[self.config.difficulty]
        self._lookups = tuple(f"lookup[{k}]" for k in LOOKUP_KEYWORDS)

    def vocabulary(self) -> frozenset[str]:
        """See the module function `vocabulary`."""
        return vocabulary()

    # --- episode --------------------------------------------------------------
    def _start(self, index: int) -> Observation:
        c = self.config
        self._question = q = _question(c.seed, c.split, c.difficulty, index)
        self._page = ""
        self._keyword = ""
        self._results: list[int] = []
        self._count = 0
        self._revealed: set[tuple[str, int]] = set()
        self._searches: dict[str, str] = {}
        self._answers: dict[str, str] = {}
        return self._view(START_TEXT, q.mentions, q.mentions + ("yes", "no"))

    def _act(self, action: str) -> Outcome:
        observation, reward, done, info = self._answer(action)
        # The question kind, as ALFWorld's task type, lets evaluation report success per kind.
        return observation, reward, done, {**info, "task_type": self._question.kind}

    def _answer(self, action: str) -> Outcome:
        parsed = bracket_command(action)
        if parsed is None or parsed[0] not in ("search", "lookup", "finish"):
            return self._invalid(BAD_FORMAT)
        verb, arg = parsed
        key = " ".join(w for w in words(arg) if w.isalnum())
        if not key:
            return self._invalid(EMPTY_ARGUMENT)
        if verb == "finish":
            answer = self._question.answer
            em = float(normalize_answer(arg) == normalize_answer(answer))
            f1 = f1_score(arg, answer)
            obs = Observation(f"Episode finished, reward = {int(em)}", (),
                              f"{self._page}|finished", self._question.text)
            return obs, em, True, step_info(valid=True, won=em == 1.0, score=em, em=em, f1=f1)
        if verb == "search":
            entity = self._kb.entities.get(key)
            if entity is None:
                similar = self._kb.similar(key.split())
                listing = ", ".join(f"'{_title(s)}'" for s in similar)
                self._page = ""
                return self._ok(f"Could not find that entity. Similar: [{listing}].",
                                tuple(similar), ())
            self._page, self._keyword, self._results, self._count = key, "", [], 0
            shown = range(min(self._visible, len(entity.sentences)))
            for i in shown:
                self._revealed.add((key, i))
            return self._ok(" ".join(entity.sentences[i] for i in shown),
                            tuple(m for i in shown for m in entity.mentions[i]),
                            tuple(v for i in shown for v in entity.values[i]))
        if not self._page:
            return self._invalid(NO_PAGE)
        entity = self._kb.entities[self._page]
        if key != self._keyword:
            target = frozenset(key.split())
            self._keyword, self._count = key, 0
            self._results = [i for i, ws in enumerate(entity.word_sets) if target <= ws]
        if self._count >= len(self._results):
            return self._ok(NO_MORE, (), ())
        i = self._results[self._count]
        self._count += 1
        self._revealed.add((self._page, i))
        return self._ok(f"(Result {self._count} / {len(self._results)}) {entity.sentences[i]}",
                        entity.mentions[i], entity.values[i])

    def _ok(self, text: str, mentions: tuple[str, ...], values: tuple[str, ...]) -> Outcome:
        return self._view(text, mentions, values), 0.0, False, step_info(valid=True)

    def _view(self, text: str, mentions: tuple[str, ...], values: tuple[str, ...]) -> Observation:
        # The listed searches and answers are the entities and values the agent
        # has read so far (its notes), so that the oracle's actions are listed too.
        for m in mentions:
            if m not in self._searches:
                self._searches[m] = f"search[{_title(m)}]"
        for v in values:
            if v not in self._answers:
                self._answers[v] = f"finish[{_title(v)}]"
        actions = list(self._searches.values())
        if self._page:
            actions.extend(self._lookups)
        actions.extend(self._answers.values())
        anchor = f"{self._page}|{self._keyword}|{self._count}|{text}"
        return Observation(text, tuple(actions), anchor, self._question.text)

    # --- oracle ---------------------------------------------------------------
    def oracle_actions(self) -> tuple[str, ...]:
        """The actions of a shortest solution from the current state: for each
        entity holding an unread supporting fact (the open page first, then in
        hop order) a search unless it is open, a lookup per unread fact the
        search does not show, then `finish` with the answer."""
        self._require_state("oracle_actions")
        unread: dict[str, list[int]] = {}
        for key, i in self._question.facts:
            if (key, i) not in self._revealed:
                unread.setdefault(key, []).append(i)
        order = sorted(unread, key=lambda k: k != self._page)
        plan = []
        for key in order:
            entity = self._kb.entities[key]
            if key != self._page:
                plan.append(f"search[{entity.name}]")
            for i in unread[key]:
                if key == self._page or i >= self._visible:
                    plan.append(f"lookup[{_fact_keyword(entity, i)}]")
        plan.append(f"finish[{_title(self._question.answer)}]")
        return tuple(plan)

    def oracle_distance(self) -> int:
        """The number of steps of a shortest solution from the current state."""
        return len(self.oracle_actions())

    # --- ground truth for the trainer ------------------------------------------
    answer_action = "finish[{}]"
    """The action that answers with `answer_action.format(answer)`."""

    def reference_answer(self) -> str:
        """The current task's ground-truth answer, as `finish[...]` spells it (title case).

        For information-gain credit (IGPO, `stepcredit.train.information_gain`:
        the policy's belief in this answer after each step). No observation,
        admissible list or info carries it until the agent reads it: it is
        answered from any state of the episode, finished ones included.

        Raises:
          RuntimeError: no episode was started.
        """
        if self._obs is None:
            raise RuntimeError(f"{type(self).__name__}.reference_answer: no episode was started "
                               "(call reset)")
        return _title(self._question.answer)


def _fact_keyword(entity: _Entity, i: int) -> str:
    """The lookup keyword that finds sentence i of a paragraph, and only it."""
    relation = next(r for r, j in entity.fact_index.items() if j == i)
    return "city" if relation == "intro" else relation
