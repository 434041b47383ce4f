"""An embedded online shop in the shape of WebShop's text environment.

A generated catalogue (1,200 products over five categories, each product with a
type, attributes, options such as size or color, and a price) sits behind a
search engine. An instruction in WebShop's style ("i need a machine washable
t-shirt, size: large, and price lower than 30.00 dollars") names a product type,
attributes, option values and a budget. The agent searches (`search[query]`),
pages through results (`click[next >]`, `click[< prev]`), opens products
(`click[b0042]`), picks options (`click[large]`), goes back
(`click[< prev]`, `click[back to search]`) and buys (`click[buy now]`).

Reward (WebShop, arXiv 2207.01206, eq. 1) for the bought product y and goal u:
  r = r_type * (|U_att & Y_att| + |U_opt & Y_opt| + 1[y_price <= u_price])
      / (|U_att| + |U_opt| + 1)
with r_type = 1 for the right product type, 0.5 for another type of the same
category and 0.1 otherwise. Success is r = 1.

Differences from WebShop: the catalogue is generated, not scraped; products have
no description, features or reviews pages; search ranks by the number of query
words a product's title and options contain (WebShop uses BM25 over scraped
text); attributes and r_type match exactly instead of by text similarity; and
item pages mark the selected options, since the observation carries no history.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import random
from typing import Any

from stepcredit.envs._sim import Outcome, SimulatorEnv, task_rng
from stepcredit.envs._text import bracket_command, squeeze, stable_bucket, vocabulary_of, words
from stepcredit.envs.base import Observation, step_info

PAGE_SIZE = 10
MAX_RESULTS = 50
NUM_PRODUCTS = 1200
SEP = " [SEP] "

BAD_FORMAT = "Invalid action: use search[query] or click[button]."
NO_SEARCH_BAR = "Invalid action: there is no search bar on this page."
NO_BUTTON = "Invalid action: there is no such button on this page."
EMPTY_QUERY = "Invalid action: the search query is empty."


@dataclasses.dataclass(frozen=True)
class _Category:
    types: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]


_CATEGORIES = {
    "fashion": _Category(
        ("t-shirt", "hoodie", "sneakers", "jeans", "dress", "jacket", "socks", "sweater"),
        ("machine washable", "long sleeve", "short sleeve", "slim fit", "relaxed fit", "cotton",
         "water resistant", "breathable", "lightweight", "hand wash"),
        (("size", ("small", "medium", "large", "x-large")),
         ("color", ("black", "white", "navy", "red", "grey", "green", "beige", "pink")))),
    "beauty": _Category(
        ("shampoo", "conditioner", "face cream", "lipstick", "body lotion", "sunscreen",
         "hair oil", "nail polish"),
        ("paraben free", "cruelty free", "long lasting", "natural ingredients", "fragrance free",
         "sensitive skin", "vegan", "travel size"),
        (("scent", ("lavender", "vanilla", "rose", "citrus", "unscented", "coconut")),
         ("count", ("pack of 1", "pack of 2", "pack of 3")))),
    "grocery": _Category(
        ("coffee beans", "green tea", "protein bars", "olive oil", "dark chocolate", "granola",
         "peanut butter", "sparkling water"),
        ("gluten free", "sugar free", "organic", "non gmo", "low carb", "keto friendly",
         "high protein", "kosher"),
        (("flavor", ("original", "chocolate", "caramel", "mint", "honey", "berry")),
         ("count", ("pack of 1", "pack of 2", "pack of 4", "pack of 6")))),
    "electronics": _Category(
        ("wireless earbuds", "phone case", "usb cable", "power bank", "bluetooth speaker",
         "smart watch", "laptop stand", "hdmi cable"),
        ("fast charging", "noise cancelling", "waterproof", "long battery life", "portable",
         "high speed", "easy to install", "compact"),
        (("color", ("black", "white", "silver", "blue", "red")),
         ("style", ("standard", "pro", "mini")))),
    "home": _Category(
        ("throw pillow", "bath towel", "table lamp", "storage basket", "wall clock",
         "scented candle", "bed sheets", "area rug"),
        ("easy to clean", "non slip", "handmade", "eco friendly", "soft", "durable",
         "modern style", "space saving"),
        (("color", ("white", "grey", "blue", "brown", "green", "yellow")),
         ("size", ("small", "medium", "large", "queen", "king")))),
}
_BRANDS = ("acme", "nordic", "zenith", "lumen", "vexa", "orbit", "kinto", "solace", "maple",
           "terra", "bolt", "aurora", "pinecrest", "harbor", "cobalt", "willow", "summit", "nova",
           "ember", "atlas", "cedar", "lark", "fable", "quill")
_CENTS = (0, 49, 99)
_ATTRIBUTES_PER_GOAL = (1, 2, 3)
_OPTIONS_PER_GOAL = (0, 1, 2)
_TEMPLATES = ("i need a {what}, and price lower than {budget}.00 dollars",
              "i am looking for a {what}, and price lower than {budget}.00 dollars",
              "i want to buy a {what}, and price lower than {budget}.00 dollars")


@dataclasses.dataclass(frozen=True)
class WebShopConfig:
    """Configuration of `WebShopEnv`.

    Attributes:
      split: "train" or "test" (a stable hash of the instruction decides the
        split, so the two never share an instruction).
      difficulty: the goal names 1, 2 or 3 attributes and 0, 1 or 2 options at
        difficulty 0, 1 or 2.
      seed: the catalogue and task seed.
      max_steps: the step limit (WebShop's default in verl-agent is 15).
      num_train_tasks: tasks in "train".
      num_test_tasks: tasks in "test".
    """

    split: str = "train"
    difficulty: int = 1
    seed: int = 0
    max_steps: int = 15
    num_train_tasks: int = 10_000
    num_test_tasks: int = 1_000


@dataclasses.dataclass(frozen=True)
class _Product:
    pid: str
    category: str
    ptype: str
    title: str
    attributes: frozenset[str]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    cents: int
    price: str


class _Catalogue:
    """The products, an inverted index for search and caches of rendered pages
    (shared by all environments of one seed, so a group's members reuse them)."""

    def __init__(self, seed: int):
        rng = random.Random(f"webshop/catalogue/{seed}")
        categories = sorted(_CATEGORIES)
        products = []
        for i in range(NUM_PRODUCTS):
            category = categories[i % len(categories)]
            spec = _CATEGORIES[category]
            ptype = rng.choice(spec.types)
            attributes = rng.sample(spec.attributes, rng.randint(2, 4))
            options = tuple((name, tuple(v for v in values if v in chosen))
                            for name, values in spec.options
                            for chosen in [set(rng.sample(values, rng.randint(2, len(values))))])
            dollars, cents = rng.randint(5, 119), rng.choice(_CENTS)
            products.append(_Product(
                f"b{i:04d}", category, ptype, f"{rng.choice(_BRANDS)} {' '.join(attributes)} {ptype}",
                frozenset(attributes), options, dollars * 100 + cents, f"${dollars}.{cents:02d}"))
        self.products = tuple(products)
        self.by_pid = {p.pid: i for i, p in enumerate(products)}
        postings: dict[str, list[int]] = {}
        for i, p in enumerate(products):
            text = p.title + " " + " ".join(v for _, values in p.options for v in values)
            for w in _query_key(text):
                postings.setdefault(w, []).append(i)
        self.postings = {w: tuple(ps) for w, ps in postings.items()}
        self.posting_sets = {w: frozenset(ps) for w, ps in postings.items()}
        self.by_type: dict[str, list[int]] = {}
        for i, p in enumerate(products):
            self.by_type.setdefault(p.ptype, []).append(i)
        # A fixed tie-break among equally good matches, so that result order is
        # neither the catalogue order nor the same for every query.
        self.rank = list(range(len(products)))
        rng.shuffle(self.rank)
        self._search_cache: dict[frozenset[str], tuple[int, ...]] = {}
        self.results_pages: dict[tuple[frozenset[str], int], tuple[Any, ...]] = {}
        self.item_pages: dict[tuple[int, str], tuple[Any, ...]] = {}
        self.type_queries = tuple(f"search[{t}]" for c in categories for t in _CATEGORIES[c].types)

    def search(self, query_key: frozenset[str]) -> tuple[int, ...]:
        """The indices of the top `MAX_RESULTS` products for a set of query words."""
        hit = self._search_cache.get(query_key)
        if hit is not None:
            return hit
        counts = collections.Counter(itertools.chain.from_iterable(
            self.postings.get(w, ()) for w in query_key))
        by_score: dict[int, list[int]] = {}
        for i, count in counts.items():
            by_score.setdefault(count, []).append(i)
        # Only the best-scoring buckets need sorting by the tie-break rank.
        ranked: list[int] = []
        for count in sorted(by_score, reverse=True):
            ranked.extend(sorted(by_score[count], key=self.rank.__getitem__))
            if len(ranked) >= MAX_RESULTS:
                break
        results = tuple(ranked[:MAX_RESULTS])
        if len(self._search_cache) > 100_000:  # free-text queries are unbounded
            self._search_cache.clear()
            self.results_pages.clear()
            self.item_pages.clear()
        self._search_cache[query_key] = results
        return results


@functools.lru_cache(maxsize=8)
def _catalogue(seed: int) -> _Catalogue:
    return _Catalogue(seed)


# Words of the instruction templates that are not about the product; neither
# products nor queries are indexed by them, so searching a whole instruction
# ranks like searching its keywords.
_STOPWORDS = frozenset({"a", "am", "and", "buy", "dollars", "for", "i", "looking", "lower", "need",
                        "of", "price", "than", "the", "to", "want", "with"})


def _query_key(query: str) -> frozenset[str]:
    return frozenset(w for w in words(query) if w.isalnum() and w not in _STOPWORDS)


@dataclasses.dataclass(frozen=True)
class _Goal:
    instruction: str
    category: str
    ptype: str
    attributes: frozenset[str]
    options: tuple[tuple[str, str], ...]
    budget_cents: int
    satisfying: frozenset[int]
    query: str
    search_actions: tuple[str, ...]


def reward(goal: _Goal, product: _Product, selected: dict[str, str]) -> float:
    """WebShop's reward for buying `product` with options `selected` (module docstring)."""
    if product.ptype == goal.ptype:
        r_type = 1.0
    else:
        r_type = 0.5 if product.category == goal.category else 0.1
    matched = (len(goal.attributes & product.attributes)
               + sum(selected.get(name) == value for name, value in goal.options)
               + (product.cents <= goal.budget_cents))
    return r_type * matched / (len(goal.attributes) + len(goal.options) + 1)


@functools.lru_cache(maxsize=4096)
def _goal(seed: int, split: str, difficulty: int, index: int) -> _Goal:
    catalogue = _catalogue(seed)
    n_att, n_opt = _ATTRIBUTES_PER_GOAL[difficulty], _OPTIONS_PER_GOAL[difficulty]
    for attempt in itertools.count():
        rng = task_rng("webshop", seed, split, difficulty, index, attempt)
        target = rng.choice(catalogue.products)
        if len(target.attributes) < n_att:
            continue
        attributes = rng.sample(sorted(target.attributes), n_att)
        options = tuple((name, rng.choice(values))
                        for name, values in rng.sample(target.options, n_opt))
        budget = (target.cents // 1000 + 1) * 10
        what = " ".join(attributes) + " " + target.ptype + "".join(
            f", {name}: {value}" for name, value in options)
        instruction = rng.choice(_TEMPLATES).format(what=what, budget=budget)
        if (stable_bucket(instruction, 10) == 0) != (split == "test"):
            continue
        goal_options = {value for _, value in options}
        products = catalogue.products
        satisfying = frozenset(
            i for i in catalogue.by_type[target.ptype]
            for p in [products[i]] if p.cents <= budget * 100
            and p.attributes.issuperset(attributes)
            and goal_options.issubset(v for _, values in p.options for v in values))
        query = " ".join(attributes + [target.ptype] + [value for _, value in options])
        # The oracle's query must show a satisfying product on its first page:
        # that is what makes "search, click, options, buy" a shortest solution.
        # The target matches every query word, so the first page starts with the
        # products that match them all, in tie-break order.
        key = _query_key(query)
        full_matches = frozenset.intersection(*(catalogue.posting_sets[w] for w in key))
        first_page = sorted(full_matches, key=catalogue.rank.__getitem__)[:PAGE_SIZE]
        if not satisfying.intersection(first_page):
            continue
        # The search page lists a search per product type and the goal's keyword
        # query, at a position that varies with the task.
        searches = list(catalogue.type_queries)
        searches.insert(stable_bucket(query, len(searches) + 1), f"search[{query}]")
        return _Goal(instruction, target.category, target.ptype, frozenset(attributes), options,
                     budget * 100, satisfying, query, tuple(searches))
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=1)
def vocabulary() -> frozenset[str]:
    """The words (see `stepcredit.envs._text.words`) that WebShop observations,
    instructions and admissible actions can contain."""
    texts = [" ".join(_BRANDS), " ".join(str(i) for i in range(1000)),
             " ".join(f"{i:02d}" for i in range(10)), " ".join(f"b{i:04d}" for i in range(NUM_PRODUCTS)),
             BAD_FORMAT, NO_SEARCH_BAR, NO_BUTTON, EMPTY_QUERY,
             "webshop [SEP] search back to search page (total results: ) next > < prev price: $ "
             "rating: n.a. buy now (selected) thank you for shopping with us! your score: . "
             "search[ ] click[ ]"]
    texts += [t.format(what="soft, size: small", budget=10) for t in _TEMPLATES]
    for spec in _CATEGORIES.values():
        texts += list(spec.types) + list(spec.attributes)
        texts += [f"{name}: {' '.join(values)}" for name, values in spec.options]
    # The page title "WebShop" is mixed case: kept whole so that case-preserving
    # word tokenizers reproduce it exactly.
    return frozenset(vocabulary_of(texts) | {"WebShop"})


class WebShopEnv(SimulatorEnv):
    """WebShop-style shopping; see the module docstring.

    Args:
      config: a `WebShopConfig`; keyword arguments override its fields.

    On the search page the admissible actions list one `search[...]` per product
    type and the goal's keyword query, though any query is accepted. `info["score"]` is the reward of the
    purchase (0 before it).
    """

    name = "webshop"
    splits = ("train", "test")
    # What `_start` and `_act` set or change: the state a snapshot copies.
    _episode_state = ("_goal", "_query", "_results_anchor", "_results", "_page", "_item",
                      "_selected", "_buttons")

    def __init__(self, config: WebShopConfig | None = None, **overrides: Any):
        super().__init__(dataclasses.replace(config or WebShopConfig(), **overrides))
        self._catalogue = _catalogue(self.config.seed)
        self._goal: _Goal | None = None

    def vocabulary(self) -> frozenset[str]:
        """See the module function `vocabulary`."""
        return vocabulary()

    # --- episode --------------------------------------------------------------
    def _start(self, index: int) -> Observation:
        c = self.config
        self._goal = _goal(c.seed, c.split, c.difficulty, index)
        self._query: frozenset[str] = frozenset()
        self._results_anchor = ""
        self._results: tuple[int, ...] = ()
        self._page = 0
        self._item = -1
        self._selected: dict[str, str] = {}
        return self._search_page()

    def _act(self, action: str) -> Outcome:
        parsed = bracket_command(action)
        if parsed is None:
            return self._invalid(BAD_FORMAT)
        verb, arg = parsed
        if verb == "search":
            if self._obs.anchor != "search":
                return self._invalid(NO_SEARCH_BAR)
            key = _query_key(arg)
            if not key:
                return self._invalid(EMPTY_QUERY)
            self._query, self._results = key, self._catalogue.search(key)
            self._results_anchor = " ".join(sorted(key))
            return self._ok(self._results_page(1))
        if verb != "click":
            return self._invalid(BAD_FORMAT)
        button = self._buttons.get(arg)
        if button is None:
            # A word-level detokenizer may space words apart ("next >" as "next>").
            key = squeeze(arg)
            button = next((b for name, b in self._buttons.items() if squeeze(name) == key), None)
            if button is None:
                return self._invalid(NO_BUTTON)
        kind, value = button
        if kind == "search":
            return self._ok(self._search_page())
        if kind == "page":
            return self._ok(self._results_page(self._page if value is None else value))
        if kind == "item":
            self._item, self._selected = value, {}
            return self._ok(self._item_page())
        if kind == "option":
            self._selected[value[0]] = value[1]
            return self._ok(self._item_page())
        score = reward(self._goal, self._catalogue.products[self._item], self._selected)
        won = score == 1.0
        text = f"Thank you for shopping with us!{SEP}Your score: {score:.2f}"
        obs = Observation(text, (), f"done|{self._item}|{self._selected_key()}",
                          self._goal.instruction)
        return obs, score, True, step_info(valid=True, won=won, score=score)

    def _ok(self, obs: Observation) -> Outcome:
        return obs, 0.0, False, step_info(valid=True)

    def _search_page(self) -> Observation:
        self._buttons: dict[str, tuple[str, Any]] = {}
        return Observation(f"WebShop{SEP}Search", self._goal.search_actions, "search",
                           self._goal.instruction)

    def _results_page(self, page: int) -> Observation:
        results, catalogue = self._results, self._catalogue
        self._page, self._item = page, -1
        cache_key = (self._query, page)
        cached = catalogue.results_pages.get(cache_key)
        if cached is None:
            last = max(1, -(-len(results) // PAGE_SIZE))
            shown = results[(page - 1) * PAGE_SIZE:page * PAGE_SIZE]
            buttons: dict[str, tuple[str, Any]] = {"back to search": ("search", None)}
            parts = ["Back to Search", f"Page {page} (Total results: {len(results)})"]
            if page > 1:
                buttons["< prev"] = ("page", page - 1)
                parts.append("< Prev")
            if page < last:
                buttons["next >"] = ("page", page + 1)
                parts.append("Next >")
            for i in shown:
                p = catalogue.products[i]
                buttons[p.pid] = ("item", i)
                parts += [p.pid, p.title, p.price]
            cached = (SEP.join(parts), tuple(f"click[{b}]" for b in buttons), buttons,
                      f"results|{' '.join(sorted(self._query))}|{page}")
            catalogue.results_pages[cache_key] = cached
        text, actions, self._buttons, anchor = cached
        return Observation(text, actions, anchor, self._goal.instruction)

    def _item_page(self) -> Observation:
        selected = self._selected_key()
        cache_key = (self._item, selected)
        cached = self._catalogue.item_pages.get(cache_key)
        if cached is None:
            product = self._catalogue.products[self._item]
            buttons: dict[str, tuple[str, Any]] = {"back to search": ("search", None),
                                                    "< prev": ("page", None)}
            parts = ["Back to Search", "< Prev"]
            for name, values in product.options:
                parts.append(name)
                for v in values:
                    buttons[v] = ("option", (name, v))
                    parts.append(f"{v} (selected)" if self._selected.get(name) == v else v)
            buttons["buy now"] = ("buy", None)
            parts += [product.title, f"Price: {product.price}", "Rating: N.A.", "Buy Now"]
            cached = (SEP.join(parts), tuple(f"click[{b}]" for b in buttons), buttons,
                      f"item|{product.pid}|{selected}|")
            self._catalogue.item_pages[cache_key] = cached
        text, actions, self._buttons, anchor = cached
        # The page `< prev` returns to is part of the state but not of the page.
        return Observation(text, actions, f"{anchor}{self._results_anchor}|{self._page}",
                           self._goal.instruction)

    def _selected_key(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self._selected.items()))

    # --- oracle ---------------------------------------------------------------
    def oracle_actions(self) -> tuple[str, ...]:
        """The actions of a shortest purchase with reward 1 from the current state.

        From the search page: the goal's keyword query (it shows a satisfying
        product on page 1, and no query can do better), the product, each goal
        option, buy. On a results page: page to the nearest page with a
        satisfying product, unless going back to search is shorter. On a product
        page: the missing options and buy if the product satisfies the goal, else
        back to the results or to search, whichever is shorter.
        """
        self._require_state("oracle_actions")
        kind = self._obs.anchor.partition("|")[0]
        if kind == "search":
            return self._plan_from_search()
        if kind == "results":
            return self._plan_from_results()
        goal = self._goal
        if self._item in goal.satisfying:
            return tuple(f"click[{value}]" for name, value in goal.options
                         if self._selected.get(name) != value) + ("click[buy now]",)
        via_results = self._plan_from_results()
        via_search = self._plan_from_search()
        if len(via_results) <= len(via_search):
            return ("click[< prev]",) + via_results
        return ("click[back to search]",) + via_search

    def oracle_distance(self) -> int:
        """The number of steps of a shortest purchase with reward 1."""
        return len(self.oracle_actions())

    def _plan_from_search(self) -> tuple[str, ...]:
        goal = self._goal
        first_page = self._catalogue.search(_query_key(goal.query))[:PAGE_SIZE]
        pick = next(i for i in first_page if i in goal.satisfying)
        return (f"search[{goal.query}]",) + self._plan_from_pick(pick)

    def _plan_from_pick(self, i: int) -> tuple[str, ...]:
        return ((f"click[{self._catalogue.products[i].pid}]",)
                + tuple(f"click[{value}]" for _, value in self._goal.options) + ("click[buy now]",))

    def _plan_from_results(self) -> tuple[str, ...]:
        """Shortest plan from the results page `self._page` of the current query
        (also used from a product page, whose `< prev` returns there)."""
        satisfying, results = self._goal.satisfying, self._results
        best: tuple[str, ...] = ("click[back to search]",) + self._plan_from_search()
        for j, i in enumerate(results):
            if i not in satisfying:
                continue
            page = j // PAGE_SIZE + 1
            moves = page - self._page
            button = "click[next >]" if moves > 0 else "click[< prev]"
            plan = (button,) * abs(moves) + self._plan_from_pick(i)
            if len(plan) < len(best):
                best = plan
        return best
