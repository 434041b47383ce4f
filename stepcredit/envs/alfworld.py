"""An embedded household simulator in the shape of ALFWorld's text games.

Rooms (kitchen, living room, bedroom, bathroom) hold numbered receptacles
("cabinet 2", "fridge 1") and objects ("apple 1"). The agent starts in the middle
of the room, holds at most one object, and plays ALFWorld's six task types with
ALFWorld's commands and answers (`go to X`, `take X from Y`, `put X in/on Y`,
`open X`, `close X`, `clean/heat/cool X with Y`, `use X`, `examine X`, `look`,
`inventory`; "Nothing happens." to anything else). Reward 1 on success.

Differences from ALFWorld (arXiv 2010.03768): layouts are generated rather than
taken from AI2-THOR scenes, every pickable object fits every receptacle, heating,
cooling and cleaning work on the held object without opening the appliance, and
the goal receptacle is never an appliance. Splits: "train" and "seen" share
layouts 0-31 (a task's full initial state decides its split, so the two never
share a task); "unseen" uses layouts 32-39, never seen in training.

References:
  Shridhar et al., "ALFWorld: Aligning Text and Embodied Environments for
  Interactive Learning", arXiv 2010.03768.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from typing import Any

from stepcredit.envs._sim import Outcome, SimulatorEnv, task_rng
from stepcredit.envs._text import squeeze, stable_bucket, vocabulary_of
from stepcredit.envs.base import Observation, step_info

TASK_TYPES = ("pick_and_place", "look_at_obj_in_light", "pick_clean_then_place",
              "pick_heat_then_place", "pick_cool_then_place", "pick_two_obj")

NOTHING_HAPPENS = "Nothing happens."

_CLEAN, _HOT, _COOL = 1, 2, 4
# task type -> (appliance receptacle type, command verb, state bit it sets)
_MODIFIERS = {
    "pick_clean_then_place": ("sinkbasin", "clean", _CLEAN),
    "pick_heat_then_place": ("microwave", "heat", _HOT),
    "pick_cool_then_place": ("fridge", "cool", _COOL),
}
_APPLIANCE_VERB = {"sinkbasin": ("clean", _CLEAN), "microwave": ("heat", _HOT),
                   "fridge": ("cool", _COOL)}
_OPENABLE = frozenset({"fridge", "microwave", "cabinet", "drawer", "safe"})
# Appliances are never goal receptacles; the ones below fridge never hold an
# object at the start either (food in a fridge is fine, a mug in a toaster is not).
_NOT_GOAL = frozenset({"fridge", "microwave", "sinkbasin", "stoveburner", "coffeemachine",
                       "toaster"})
_NOT_START = _NOT_GOAL - {"fridge"}
_HEATABLE = frozenset({"apple", "bread", "egg", "potato", "tomato", "mug", "cup", "plate"})
_COOLABLE = _HEATABLE | {"lettuce", "bowl", "pan", "pot", "winebottle"}
_CLEANABLE = frozenset({"apple", "lettuce", "potato", "tomato", "mug", "cup", "bowl", "plate",
                        "pan", "pot", "knife", "fork", "spoon", "spatula", "ladle", "soapbar",
                        "cloth", "handtowel"})
_LOOKABLE = frozenset({"alarmclock", "book", "cellphone", "creditcard", "keychain", "pen",
                       "pencil", "cd", "remotecontrol", "watch", "statue", "vase", "newspaper",
                       "laptop", "pillow", "bowl", "mug"})
_LAMP = "desklamp 1"


@dataclasses.dataclass(frozen=True)
class _RoomSpec:
    """What a room kind may contain: (receptacle type, min count, max count),
    the receptacle that is always present, the pickable object types and the
    receptacle types that may carry the desk lamp."""

    receptacles: tuple[tuple[str, int, int], ...]
    anchor_surface: str
    objects: tuple[str, ...]
    lamp_on: tuple[str, ...] = ()


_ROOM_KINDS = ("kitchen", "livingroom", "bedroom", "bathroom")
_ROOMS = {
    "kitchen": _RoomSpec(
        (("countertop", 1, 3), ("cabinet", 2, 6), ("drawer", 1, 4), ("fridge", 1, 1),
         ("microwave", 1, 1), ("sinkbasin", 1, 1), ("stoveburner", 2, 4), ("diningtable", 0, 1),
         ("garbagecan", 1, 1), ("shelf", 0, 2), ("coffeemachine", 1, 1), ("toaster", 0, 1)),
        "countertop",
        ("apple", "bread", "egg", "lettuce", "potato", "tomato", "mug", "cup", "bowl", "plate",
         "pan", "pot", "knife", "fork", "spoon", "spatula", "ladle", "kettle", "saltshaker",
         "peppershaker", "dishsponge", "winebottle")),
    "livingroom": _RoomSpec(
        (("sofa", 1, 1), ("armchair", 0, 2), ("coffeetable", 1, 1), ("sidetable", 1, 3),
         ("tvstand", 0, 1), ("shelf", 0, 3), ("drawer", 0, 4), ("cabinet", 0, 3),
         ("garbagecan", 1, 1), ("dresser", 0, 1), ("diningtable", 0, 1)),
        "coffeetable",
        ("remotecontrol", "keychain", "newspaper", "statue", "vase", "watch", "creditcard",
         "laptop", "pillow", "book", "cellphone", "pen", "pencil", "tissuebox", "candle"),
        ("sidetable", "dresser")),
    "bedroom": _RoomSpec(
        (("bed", 1, 1), ("desk", 1, 1), ("dresser", 0, 1), ("drawer", 1, 5), ("shelf", 0, 4),
         ("sidetable", 0, 2), ("garbagecan", 1, 1), ("laundryhamper", 0, 1), ("safe", 0, 1),
         ("armchair", 0, 1)),
        "bed",
        ("alarmclock", "book", "cellphone", "creditcard", "keychain", "laptop", "pen", "pencil",
         "pillow", "cd", "mug", "bowl", "teddybear", "baseballbat", "tennisracket", "watch"),
        ("desk", "sidetable")),
    "bathroom": _RoomSpec(
        (("toilet", 1, 1), ("sinkbasin", 1, 1), ("bathtubbasin", 0, 1), ("countertop", 1, 1),
         ("cabinet", 1, 4), ("drawer", 0, 4), ("shelf", 0, 2), ("garbagecan", 1, 1),
         ("towelholder", 0, 1), ("toiletpaperhanger", 1, 1)),
        "countertop",
        ("soapbar", "soapbottle", "spraybottle", "toiletpaper", "candle", "cloth", "dishsponge",
         "handtowel", "towel", "plunger", "scrubbrush", "tissuebox")),
}
_NUM_LAYOUTS = 40
_FIRST_UNSEEN_LAYOUT = 32  # layouts 32-39 (two per room kind) appear only in "unseen"
_ROOM_SIZE = (6, 11, 10_000)  # receptacles kept per difficulty
_DISTRACTORS = (3, 6, 10)  # distractor objects per difficulty

_TEMPLATES = {
    "pick_and_place": ("put a {t} in {r}.", "put some {t} on {r}."),
    "look_at_obj_in_light": ("look at {t} under the desklamp.", "examine the {t} with the desklamp."),
    "pick_clean_then_place": ("put a clean {t} in {r}.", "clean some {t} and put it in {r}."),
    "pick_heat_then_place": ("put a hot {t} in {r}.", "heat some {t} and put it in {r}."),
    "pick_cool_then_place": ("put a cool {t} in {r}.", "cool some {t} and put it in {r}."),
    "pick_two_obj": ("put two {t} in {r}.", "find two {t} and put them in {r}."),
}


@dataclasses.dataclass(frozen=True)
class AlfWorldConfig:
    """Configuration of `AlfWorldEnv`.

    Attributes:
      split: "train", "seen" (training layouts, held-out tasks) or "unseen"
        (held-out layouts).
      difficulty: 0 (6 receptacles, 3 distractors, targets in plain sight),
        1 (11 receptacles, 6 distractors) or 2 (the whole room, 10 distractors).
      seed: the world seed (layouts and tasks).
      max_steps: the step limit (ALFWorld's default is 50).
      num_train_tasks: tasks in "train".
      num_test_tasks: tasks in "seen" and in "unseen".
      task_types: the task types to draw from; task i has type
        `task_types[i % len(task_types)]`.
    """

    split: str = "train"
    difficulty: int = 1
    seed: int = 0
    max_steps: int = 50
    num_train_tasks: int = 10_000
    num_test_tasks: int = 1_000
    task_types: tuple[str, ...] = TASK_TYPES


@dataclasses.dataclass(frozen=True)
class _Room:
    """A generated layout: receptacle names, types and the precomputed
    `go to` lists (entry loc + 1 lists every receptacle but loc)."""

    layout: int
    kind: str
    names: tuple[str, ...]
    types: tuple[str, ...]
    openable: tuple[bool, ...]
    lamp: int
    index: dict[str, int]
    goto: tuple[tuple[str, ...], ...]
    overview: str
    goal_types: tuple[str, ...]
    starts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Task:
    """One task: the room, the goal and the initial object placement."""

    room: _Room
    task_type: str
    text: str
    target: str
    goal: str
    objects: tuple[str, ...]
    object_types: tuple[str, ...]
    positions: tuple[int, ...]
    key: str


def _listing(items: list[str]) -> str:
    if not items:
        return "nothing"
    if len(items) == 1:
        return f"a {items[0]}"
    return ", ".join(f"a {x}" for x in items[:-1]) + f", and a {items[-1]}"


@functools.lru_cache(maxsize=512)
def _room(seed: int, layout: int, difficulty: int) -> _Room:
    rng = random.Random(f"alfworld/layout/{seed}/{layout}")
    kind = _ROOM_KINDS[layout % len(_ROOM_KINDS)]
    spec = _ROOMS[kind]
    core, rest = [], []
    lamp_type = rng.choice(spec.lamp_on) if spec.lamp_on else ""
    for rtype, lo, hi in spec.receptacles:
        # The anchor surface, the appliances and the lamp's holder are always kept.
        required = rtype == spec.anchor_surface or rtype in _APPLIANCE_VERB or rtype == lamp_type
        count = rng.randint(max(lo, 1 if required else 0), hi)
        if required:
            core.append(rtype)
            count -= 1
        rest.extend([rtype] * count)
    rng.shuffle(rest)
    kept = sorted(core + rest[:max(0, _ROOM_SIZE[difficulty] - len(core))])
    numbers: dict[str, int] = {}
    names = []
    for rtype in kept:
        numbers[rtype] = numbers.get(rtype, 0) + 1
        names.append(f"{rtype} {numbers[rtype]}")
    lamp = kept.index(lamp_type) if lamp_type else -1
    goto = tuple(tuple(f"go to {n}" for j, n in enumerate(names) if j != loc)
                 for loc in range(-1, len(names)))
    overview = ("You are in the middle of a room. Looking quickly around you, you see "
                f"{_listing(names)}.")
    return _Room(layout, kind, tuple(names), tuple(kept), tuple(t in _OPENABLE for t in kept),
                 lamp, {n: i for i, n in enumerate(names)}, goto, overview,
                 tuple(sorted({t for t in kept if t not in _NOT_GOAL})),
                 tuple(i for i, t in enumerate(kept) if t not in _NOT_START))


@functools.lru_cache(maxsize=None)
def _targets(task_type: str, kind: str, has_lamp: bool) -> tuple[str, ...]:
    """The object types a task of `task_type` may ask for in a room of `kind`
    (every room of a kind has that kind's appliances)."""
    objects = set(_ROOMS[kind].objects)
    if task_type == "look_at_obj_in_light":
        return tuple(sorted(objects & _LOOKABLE)) if has_lamp else ()
    if task_type in _MODIFIERS:
        appliance = _MODIFIERS[task_type][0]
        able = {"sinkbasin": _CLEANABLE, "microwave": _HEATABLE, "fridge": _COOLABLE}[appliance]
        has_appliance = any(r == appliance for r, _, _ in _ROOMS[kind].receptacles)
        return tuple(sorted(objects & able)) if has_appliance else ()
    return tuple(sorted(objects))


def _split_layouts(split: str) -> range:
    return range(_FIRST_UNSEEN_LAYOUT, _NUM_LAYOUTS) if split == "unseen" else \
        range(_FIRST_UNSEEN_LAYOUT)


@functools.lru_cache(maxsize=4096)
def _task(seed: int, split: str, difficulty: int, task_types: tuple[str, ...],
          index: int) -> _Task:
    task_type = task_types[index % len(task_types)]
    for attempt in itertools.count():
        rng = task_rng("alfworld", seed, split, difficulty, index, attempt)
        room = _room(seed, rng.choice(_split_layouts(split)), difficulty)
        spec = _ROOMS[room.kind]
        targets, goals = _targets(task_type, room.kind, room.lamp >= 0), room.goal_types
        if not targets or not goals:
            continue
        target = rng.choice(targets)
        goal = "" if task_type == "look_at_obj_in_light" else rng.choice(goals)
        starts = room.starts
        # Targets never start in a goal receptacle (the task would be half done),
        # and at difficulty 0 never behind a door.
        target_starts = [i for i in starts if room.types[i] != goal
                         and (difficulty > 0 or not room.openable[i])]
        if not target_starts:
            continue
        if task_type == "pick_two_obj":
            n_targets = 2 + (difficulty > 0 and rng.random() < 0.5)
        else:
            n_targets = 1 + (difficulty > 1 and rng.random() < 0.5)
        others = [t for t in spec.objects if t != target]
        types = [target] * n_targets + [rng.choice(others) for _ in range(_DISTRACTORS[difficulty])]
        rng.shuffle(types)
        counts: dict[str, int] = {}
        names, positions = [], []
        for otype in types:
            counts[otype] = counts.get(otype, 0) + 1
            names.append(f"{otype} {counts[otype]}")
            positions.append(rng.choice(target_starts if otype == target else starts))
        text = rng.choice(_TEMPLATES[task_type]).format(t=target, r=goal)
        key = f"{room.layout}|{text}|{','.join(names)}|{positions}"
        # Train and seen share layouts; a stable hash of the whole task decides
        # which of the two a task belongs to, so they never share one.
        if split != "unseen" and (stable_bucket(key, 5) == 0) != (split == "seen"):
            continue
        return _Task(room, task_type, text, target, goal, tuple(names), tuple(types),
                     tuple(positions), key)
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=1)
def vocabulary() -> frozenset[str]:
    """The words (see `stepcredit.envs._text.words`) that ALFWorld observations,
    task texts and admissible actions can contain."""
    receptacles = {r for spec in _ROOMS.values() for r, _, _ in spec.receptacles}
    objects = {o for spec in _ROOMS.values() for o in spec.objects} | {"desklamp"}
    texts = [" ".join(receptacles), " ".join(objects), " ".join(str(i) for i in range(1, 21)),
             NOTHING_HAPPENS, "You are in the middle of a room. Looking quickly around you, "
             "you see a, and a. You arrive at. The is closed. The is open. In it, you see nothing. "
             "On the, you see a. You open the. You close the. You pick up the from the. You put "
             "the in/on the. You clean the using the. You heat the using the. You cool the using "
             "the. You turn on the. This is a clean hot cool. There's nothing special about. You "
             "are facing the. You are carrying: a. You are not carrying anything.",
             "go to take from put in/on open close clean heat cool with use examine look "
             "inventory"]
    texts += [t.format(t="apple", r="cabinet") for pair in _TEMPLATES.values() for t in pair]
    return frozenset(vocabulary_of(texts))


class AlfWorldEnv(SimulatorEnv):
    """ALFWorld-style household tasks; see the module docstring.

    Args:
      config: an `AlfWorldConfig`; keyword arguments override its fields
        (`AlfWorldEnv(split="unseen", difficulty=2)`).

    `info` carries `task_type` on every step.
    """

    name = "alfworld"
    splits = ("train", "seen", "unseen")
    # What `_start`, `_act` and `oracle_actions` set or change: the state a
    # snapshot copies (the plan cache too, since its key, the anchor, does not
    # name the task).
    _episode_state = ("_task", "_loc", "_held", "_lamp_on", "_pos", "_flags", "_opened", "_seen",
                      "_contents", "_object_index", "_target_objects", "_goal_set", "_need",
                      "_plan_cache")

    def __init__(self, config: AlfWorldConfig | None = None, **overrides: Any):
        config = dataclasses.replace(config or AlfWorldConfig(), **overrides)
        unknown = [t for t in config.task_types if t not in TASK_TYPES]
        if not config.task_types or unknown:
            raise ValueError(f"AlfWorldEnv: task_types {config.task_types} must be a non-empty "
                             f"subset of {TASK_TYPES}")
        super().__init__(config)
        self._task: _Task | None = None
        self._plan_cache: tuple[str, tuple[str, ...]] = ("", ())

    def vocabulary(self) -> frozenset[str]:
        """See the module function `vocabulary`."""
        return vocabulary()

    @property
    def task_type(self) -> str | None:
        """The current (or last) task's type, one of `TASK_TYPES`; None before
        the first reset."""
        return None if self._task is None else self._task.task_type

    # --- episode --------------------------------------------------------------
    def _start(self, index: int) -> Observation:
        c = self.config
        task = self._task = _task(c.seed, c.split, c.difficulty, tuple(c.task_types), index)
        room = task.room
        self._loc = -1
        self._held = -1
        self._lamp_on = False
        self._pos = list(task.positions)
        self._flags = [0] * len(task.objects)
        self._opened = [0] * len(room.names)
        self._seen: set[int] = set()  # receptacles whose contents the agent has seen
        self._contents: list[list[int]] = [[] for _ in room.names]
        for o, r in enumerate(task.positions):
            self._contents[r].append(o)
        self._object_index = {n: i for i, n in enumerate(task.objects)}
        self._target_objects = [i for i, t in enumerate(task.object_types) if t == task.target]
        self._goal_set = frozenset(i for i, t in enumerate(room.types) if t == task.goal)
        self._need = _MODIFIERS[task.task_type][2] if task.task_type in _MODIFIERS else 0
        return self._observation(room.overview)

    def _act(self, action: str) -> Outcome:
        text = self._apply(action.strip().lower())
        if text is None:
            # A word-level detokenizer may space words apart ("in / on"): retry the
            # admissible command with the same letters, if there is one.
            key = squeeze(action)
            for candidate in self._obs.admissible_actions:
                if squeeze(candidate) == key:
                    text = self._apply(candidate)
                    break
        task_type = self._task.task_type
        if text is None:
            return self._invalid(NOTHING_HAPPENS, task_type=task_type)
        won = self._won()
        return (self._observation(text), float(won), won,
                step_info(valid=True, won=won, score=float(won), task_type=task_type))

    def _apply(self, action: str) -> str | None:
        """Applies a lowercased command; returns its answer, None when invalid."""
        room = self._task.room
        verb, _, rest = action.partition(" ")
        if verb == "go":
            if not rest.startswith("to "):
                return None
            r = room.index.get(rest[3:])
            if r is None or r == self._loc:
                return None
            self._loc = r
            return f"You arrive at {room.names[r]}. {self._reveal(r)}"
        if verb == "take":
            o_name, sep, r_name = rest.partition(" from ")
            o, r = self._object_index.get(o_name), room.index.get(r_name)
            if (not sep or o is None or r != self._loc or self._held >= 0
                    or self._pos[o] != r or not self._visible(r)):
                return None
            self._contents[r].remove(o)
            self._pos[o] = -1
            self._held = o
            return f"You pick up the {o_name} from the {r_name}."
        if verb == "put":
            for sep in (" in/on ", " in ", " on "):
                o_name, found, r_name = rest.partition(sep)
                if found:
                    break
            o, r = self._object_index.get(o_name), room.index.get(r_name)
            if (not found or o is None or o != self._held or r != self._loc
                    or not self._visible(r)):
                return None
            self._contents[r].append(o)
            self._pos[o] = r
            self._held = -1
            return f"You put the {o_name} in/on the {r_name}."
        if verb in ("open", "close"):
            r = room.index.get(rest)
            if r is None or r != self._loc or not room.openable[r] or \
                    self._opened[r] == (verb == "open"):
                return None
            self._opened[r] = int(verb == "open")
            if verb == "close":
                return f"You close the {rest}."
            return f"You open the {rest}. {self._reveal(r)}"
        if verb in ("clean", "heat", "cool"):
            o_name, sep, r_name = rest.partition(" with ")
            o, r = self._object_index.get(o_name), room.index.get(r_name)
            if not sep or o is None or o != self._held or r != self._loc or \
                    _APPLIANCE_VERB.get(room.types[r], ("",))[0] != verb:
                return None
            self._flags[o] |= _APPLIANCE_VERB[room.types[r]][1]
            return f"You {verb} the {o_name} using the {r_name}."
        if verb == "use":
            if rest != _LAMP or room.lamp < 0 or self._loc != room.lamp or self._lamp_on:
                return None
            self._lamp_on = True
            return f"You turn on the {_LAMP}."
        if verb == "examine":
            r = room.index.get(rest)
            if r is not None and r == self._loc:
                return self._reveal(r)
            o = self._object_index.get(rest)
            if o is not None and o == self._held:
                adjectives = [a for bit, a in ((_CLEAN, "clean"), (_HOT, "hot"), (_COOL, "cool"))
                              if self._flags[o] & bit]
                if adjectives:
                    return f"This is a {' '.join(adjectives)} {rest}."
                return f"There's nothing special about {rest}."
            return None
        if action == "look":
            if self._loc < 0:
                return room.overview
            return f"You are facing the {room.names[self._loc]}. {self._reveal(self._loc)}"
        if action == "inventory":
            if self._held < 0:
                return "You are not carrying anything."
            return f"You are carrying: a {self._task.objects[self._held]}."
        return None

    def _visible(self, r: int) -> bool:
        return self._opened[r] or not self._task.room.openable[r]

    def _reveal(self, r: int) -> str:
        """`_describe(r)`, noting that the agent has now seen what `r` holds."""
        if self._visible(r):
            self._seen.add(r)
        return self._describe(r)

    def _describe(self, r: int) -> str:
        room, name = self._task.room, self._task.room.names[r]
        items = [self._task.objects[o] for o in self._contents[r]]
        if room.lamp == r:
            items.append(_LAMP)
        if not room.openable[r]:
            return f"On the {name}, you see {_listing(items)}."
        if not self._opened[r]:
            return f"The {name} is closed."
        return f"The {name} is open. In it, you see {_listing(items)}."

    def _won(self) -> bool:
        task = self._task
        if task.task_type == "look_at_obj_in_light":
            return (self._lamp_on and self._loc == task.room.lamp
                    and self._held >= 0 and task.object_types[self._held] == task.target)
        need, goal_set = self._need, self._goal_set
        placed = [self._pos[o] for o in self._target_objects
                  if self._pos[o] in goal_set and self._flags[o] & need == need]
        if task.task_type == "pick_two_obj":
            return len(placed) > len(set(placed))
        return bool(placed)

    def _observation(self, text: str) -> Observation:
        return Observation(text, self._admissible(), self._anchor(), self._task.text)

    def _admissible(self) -> tuple[str, ...]:
        room, loc, held = self._task.room, self._loc, self._held
        actions = list(room.goto[loc + 1])
        if loc >= 0:
            name = room.names[loc]
            visible = self._visible(loc)
            if room.openable[loc]:
                actions.append(("close " if self._opened[loc] else "open ") + name)
            if held < 0:
                if visible:
                    objects = self._task.objects
                    actions.extend([f"take {objects[o]} from {name}" for o in self._contents[loc]])
            else:
                held_name = self._task.objects[held]
                if visible:
                    actions.append(f"put {held_name} in/on {name}")
                verb = _APPLIANCE_VERB.get(room.types[loc])
                if verb:
                    actions.append(f"{verb[0]} {held_name} with {name}")
            if room.lamp == loc and not self._lamp_on:
                actions.append(f"use {_LAMP}")
            actions.append("examine " + name)
        if held >= 0:
            actions.append("examine " + self._task.objects[held])
        actions.append("inventory")
        actions.append("look")
        return tuple(actions)

    def _anchor(self) -> str:
        # Lists format in C; joining mapped strings would cost twice as much.
        return f"{self._loc}|{self._held}|{self._lamp_on:d}|{self._opened}{self._pos}{self._flags}"

    # --- oracle ---------------------------------------------------------------
    def oracle_actions(self) -> tuple[str, ...]:
        """The commands of a shortest solution from the current state.

        Every solution takes a target (dropping whatever else is held, which costs
        one `put`), applies the task's appliance if needed, and carries it to a goal
        receptacle (or to the lamp); opening is paid once per closed receptacle
        used. The plan is the shortest over the choice of target objects, goal
        receptacle and appliance. The oracle knows where every object is, seen
        or not; `expert_action` is the expert that searches.
        """
        self._require_state("oracle_actions")
        anchor = self._obs.anchor
        if self._plan_cache[0] != anchor:
            self._plan_cache = (anchor, self._shortest_plan(self._target_objects))
        return self._plan_cache[1]

    def oracle_distance(self) -> int:
        """The number of steps of a shortest solution from the current state."""
        return len(self.oracle_actions())

    def expert_action(self) -> str:
        """The next command of an expert that knows only what the agent has seen.

        The targets it knows are the ones held or lying in a receptacle whose
        contents the agent has seen (only the agent moves objects, so a seen
        receptacle stays known). With enough of them, and the lamp seen for a
        look task, it follows the oracle's shortest plan over the known targets
        (for two objects, it carries a first one to the goal while the second
        is still unknown). Otherwise it searches: it goes to the first unseen
        receptacle, in the overview's order, with those that may hold the
        target (not a goal, not an appliance) and then those in plain sight
        first, and opens it on arrival. ALFWorld's hand-coded expert searches
        in the same way (arXiv 2010.03768); unlike the oracle, which walks
        straight to objects nobody has seen, its choices follow from the
        observations, so its demonstrations can be imitated.
        """
        self._require_state("expert_action")
        task, room = self._task, self._task.room
        lamp_known = task.task_type != "look_at_obj_in_light" or room.lamp in self._seen
        known = [o for o in self._target_objects if self._pos[o] < 0 or self._pos[o] in self._seen]
        plan = self._shortest_plan(known) if lamp_known else ()
        if plan:
            return plan[0]
        unseen = [r for r in range(len(room.names)) if r not in self._seen]
        starts = set(room.starts)
        r = min(unseen, key=lambda r: (room.types[r] == task.goal or r not in starts,
                                       room.openable[r], r))
        return f"open {room.names[r]}" if r == self._loc else f"go to {room.names[r]}"

    def _shortest_plan(self, targets: list[int]) -> tuple[str, ...]:
        """The shortest plan that uses only `targets`; for two objects, one that
        places as many as `targets` allow; () when they allow no progress."""
        task, room = self._task, self._task.room
        goals = sorted(self._goal_set)
        plans = []
        if task.task_type == "look_at_obj_in_light":
            for o in targets:
                plan = _Planner(self)
                plan.take(o)
                plan.goto(room.lamp)
                if not plan.lamp_on:
                    plan.act(f"use {_LAMP}")
                plans.append(plan.actions)
        elif task.task_type == "pick_two_obj":
            placed = {r: sum(self._pos[o] == r for o in targets) for r in goals}
            for r in goals:
                outside = [o for o in targets if self._pos[o] != r]
                for chosen in itertools.permutations(outside, min(2 - placed[r], len(outside))):
                    # An unfinished plan must gather more in one goal than any holds now
                    # (or it would shuttle objects between goals); it ranks after full ones.
                    gathered = placed[r] + len(chosen)
                    if gathered < 2 and gathered <= max(placed.values()):
                        continue
                    plan = _Planner(self)
                    for o in chosen:
                        plan.take(o)
                        plan.put(o, r)
                    plans.append((gathered < 2, len(plan.actions), plan.actions))
            return tuple(min(plans, key=lambda p: p[:2])[2]) if plans else ()
        else:
            appliance, verb, bit = _MODIFIERS.get(task.task_type, ("", "", 0))
            appliances = [i for i, t in enumerate(room.types) if t == appliance] or [-1]
            for o, r, a in itertools.product(targets, goals, appliances):
                plan = _Planner(self)
                plan.take(o)
                if plan.flags[o] & bit != bit:
                    plan.goto(a)
                    plan.act(f"{verb} {task.objects[o]} with {room.names[a]}")
                    plan.flags[o] |= bit
                plan.put(o, r)
                plans.append(plan.actions)
        return tuple(min(plans, key=len)) if plans else ()


class _Planner:
    """Writes out a candidate plan from a copy of the environment's state."""

    def __init__(self, env: AlfWorldEnv):
        self.task = env._task
        self.loc, self.held, self.lamp_on = env._loc, env._held, env._lamp_on
        self.pos, self.flags, self.opened = list(env._pos), list(env._flags), list(env._opened)
        self.actions: list[str] = []

    def act(self, command: str) -> None:
        self.actions.append(command)
        if command.startswith("use "):
            self.lamp_on = True

    def goto(self, r: int) -> None:
        if self.loc != r:
            self.actions.append(f"go to {self.task.room.names[r]}")
            self.loc = r

    def open_here(self) -> None:
        r = self.loc
        if self.task.room.openable[r] and not self.opened[r]:
            self.actions.append(f"open {self.task.room.names[r]}")
            self.opened[r] = 1

    def take(self, o: int) -> None:
        if self.held == o:
            return
        r = self.pos[o]
        if self.held >= 0:
            # Drop the held object here if this receptacle is open; else where the
            # target lies (that receptacle gets opened for the take anyway).
            here = self.loc
            if here < 0 or (self.task.room.openable[here] and not self.opened[here]):
                self.goto(r)
                self.open_here()
            self.put(self.held, self.loc)
        self.goto(r)
        self.open_here()
        self.actions.append(f"take {self.task.objects[o]} from {self.task.room.names[r]}")
        self.pos[o] = -1
        self.held = o

    def put(self, o: int, r: int) -> None:
        self.goto(r)
        self.open_here()
        self.actions.append(f"put {self.task.objects[o]} in/on {self.task.room.names[r]}")
        self.pos[o] = r
        self.held = -1
