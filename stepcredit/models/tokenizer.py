"""A word-level tokenizer with exact round-trips, and the protocol every tokenizer meets.

Splitting rule (deterministic, applied to the original text):

- a run of ASCII letters is one *word* (`search`, `Shoes`);
- every digit is its own piece (`12` gives `1 2`), so that any number, price or
  product code is covered whatever the vocabulary;
- every other non-whitespace character is its own piece (`[`, `]`, `$`, `.`, `,`).

Whitespace convention (what makes `decode(encode(text)) == text` exact): every
piece comes in two tokens, bare (`shoes`) and with one leading space
(`" shoes"`), as in GPT-2. A single space before a piece is folded into that
piece's token; any other whitespace character (a second space, a newline, a tab,
a carriage return) is a token of its own. So `search[red shoes]` is
`search [ red " shoes" ]` and `$12.99` is `$ 1 2 . 9 9`: no spacing is inferred
and none is lost.

Case: the environments' vocabularies are lowercase (see `stepcredit.envs._text`).
A word found as given is one token; otherwise a capitalised word (`You`, `T`) is
`<cap>` followed by its lowercase token, an all-capitals word (`OK`) is `<upper>`
followed by its lowercase token. A word not covered in any of these ways (not in
the vocabulary, or mixed case such as `WebShop` when only `webshop` is known) is
`<unk>`: it breaks the round-trip, and `unknown_words` / `encode(...,
on_unknown="raise")` report it, never silently.

Special tokens (`SpecialIds`): `<pad>`, `<bos>` (begin of prompt), `<eoa>` (end of
action: generation stops after it), `<unk>`, and the prompt separators `<task>`,
`<obs>`, `<act>`, `<adm>` (admissible actions follow) and `<sep>` (between
admissible actions). Text never encodes to a special token: the text `<obs>` is
the three pieces `< obs >`.

Choice tokens `<1>` ... `<128>` (the last ids) label the items of a numbered list
of admissible actions, one token per item, so a policy names any item with a
single token; they decode to their number (`<21>` gives `21`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import string
from typing import Iterable, Literal, Protocol, Sequence, runtime_checkable

PAD, BOS, EOA, UNK = "<pad>", "<bos>", "<eoa>", "<unk>"
TASK, OBS, ACT, ADM, SEP = "<task>", "<obs>", "<act>", "<adm>", "<sep>"
CAP, UPPER = "<cap>", "<upper>"
SPECIAL_TOKENS = (PAD, BOS, EOA, UNK, TASK, OBS, ACT, ADM, SEP, CAP, UPPER)
WHITESPACE_TOKENS = (" ", "\n", "\t", "\r")
BASE_PIECES = tuple(string.digits) + tuple(string.punctuation)
MAX_CHOICES = 128
CHOICE_TOKENS = tuple(f"<{k}>" for k in range(1, MAX_CHOICES + 1))

_FORMAT = "stepcredit-word-tokenizer"
_VERSION = 1
# One match is either an optional single space plus one piece, or one whitespace character.
_PIECE_RE = re.compile(r" ?(?:[A-Za-z]+|[0-9]|[^\sA-Za-z0-9])|\s")
_SPLIT_RE = re.compile(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]")


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids of the special tokens the models and prompts use.

    Attributes:
      pad: padding (never attended to, never a target).
      bos: begin of a prompt.
      eoa: end of action; generation stops once it is sampled, and it counts as
        one of the action's tokens.
      unk: a word the tokenizer does not cover.
      task, obs, act: markers before the task text, an observation and an action.
      adm: marker before the list of admissible actions.
      sep: separator between two admissible actions.
      choices: the choice tokens `<1>`, `<2>`, ... that label a numbered list's
        items (empty for a tokenizer without them).
    """

    pad: int
    bos: int
    eoa: int
    unk: int
    task: int
    obs: int
    act: int
    adm: int
    sep: int
    choices: tuple[int, ...] = ()


@runtime_checkable
class Tokenizer(Protocol):
    """What the models, prompts and rollout need from a tokenizer.

    A Hugging Face `tokenizers.Tokenizer` can meet it with a thin wrapper:
    `encode(text).ids`, `decode(ids, skip_special_tokens=skip_special)`,
    `get_vocab_size()`, and the special ids from `token_to_id` after
    `add_special_tokens`.
    """

    @property
    def vocab_size(self) -> int:
        """The number of ids; every id lies in `[0, vocab_size)`."""

    @property
    def special(self) -> SpecialIds:
        """The ids of the special tokens."""

    def encode(self, text: str) -> list[int]:
        """Token ids of a text (never special ids other than `unk`)."""

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of a sequence of ids; `skip_special` drops the special tokens
        (the rollout decodes an action's text for the environment this way)."""


def split_words(text: str) -> list[str]:
    """Splits a text into the pieces the tokenizer covers, without whitespace.

    Args:
      text: any text.

    Returns:
      Letter runs, single digits and single other characters, in order
      (`"Buy $12.99 now"` gives `Buy $ 1 2 . 9 9 now`).
    """
    return _SPLIT_RE.findall(text)


class WordTokenizer:
    """A word-level tokenizer with exact round-trips over covered text.

    Build it with `WordTokenizer.from_vocabularies(env_vocab, ...)` from the
    environments' `vocabulary()` sets (iterables of words; each word is split by
    `split_words`, so `12` or `t-shirt` are fine), save it with `save`, load it
    with `WordTokenizer.load`. Ids: the special tokens first (`<pad>` is 0), then
    the whitespace tokens, then each piece bare and with a leading space, in
    sorted order, then the choice tokens, so the same vocabularies always give
    the same ids.
    """

    def __init__(self, tokens: Sequence[str]):
        """Builds a tokenizer from its full token list in id order (see `to_json`)."""
        tokens = list(tokens)
        if tuple(tokens[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(f"WordTokenizer: the token list must start with the special "
                             f"tokens {SPECIAL_TOKENS}, got {tokens[:len(SPECIAL_TOKENS)]}")
        if len(set(tokens)) != len(tokens):
            dupes = sorted({t for t in tokens if tokens.count(t) > 1})
            raise ValueError(f"WordTokenizer: duplicate tokens {dupes[:10]}")
        self._tokens = tokens
        self._ids = {tok: i for i, tok in enumerate(tokens)}
        ids = self._ids
        self._special = SpecialIds(pad=ids[PAD], bos=ids[BOS], eoa=ids[EOA], unk=ids[UNK],
                                   task=ids[TASK], obs=ids[OBS], act=ids[ACT], adm=ids[ADM],
                                   sep=ids[SEP],
                                   choices=tuple(ids[t] for t in CHOICE_TOKENS if t in ids))
        self._choice_text = {ids[t]: str(k) for k, t in enumerate(CHOICE_TOKENS, 1) if t in ids}
        self._cap, self._upper = ids[CAP], ids[UPPER]
        self._num_special = len(SPECIAL_TOKENS)

    @classmethod
    def from_vocabularies(cls, *vocabularies: Iterable[str]) -> "WordTokenizer":
        """Builds a tokenizer covering every word of the given vocabularies.

        Args:
          *vocabularies: iterables of words (e.g. each simulator's
            `vocabulary()`); every word is split with `split_words` and each
            piece is covered. Digits and ASCII punctuation are always covered.

        Returns:
          The tokenizer; equal vocabularies give equal ids, whatever the order.
        """
        pieces = set(BASE_PIECES)
        for vocab in vocabularies:
            if isinstance(vocab, str):
                raise TypeError("WordTokenizer.from_vocabularies: expected iterables of "
                                f"words, got the string {vocab[:40]!r}")
            for word in vocab:
                pieces.update(split_words(word))
        tokens = list(SPECIAL_TOKENS) + list(WHITESPACE_TOKENS)
        for piece in sorted(pieces):
            tokens += [piece, " " + piece]
        return cls(tokens + list(CHOICE_TOKENS))

    @property
    def vocab_size(self) -> int:
        """The number of ids."""
        return len(self._tokens)

    @property
    def special(self) -> SpecialIds:
        """The ids of the special tokens."""
        return self._special

    @property
    def tokens(self) -> tuple[str, ...]:
        """Every token's text, in id order."""
        return tuple(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The text of one id (special tokens by name, e.g. `<eoa>`)."""
        return self._tokens[token_id]

    def _encode_piece(self, piece: str) -> list[int] | None:
        """Ids of one piece (with its optional leading space), or None if uncovered."""
        ids = self._ids
        if piece in ids:
            return [ids[piece]]
        body = piece.lstrip(" ")
        lower = piece.lower()
        if lower in ids and body.isalpha():
            if body == body.capitalize():
                return [self._cap, ids[lower]]
            if body.isupper():
                return [self._upper, ids[lower]]
        return None

    def encode(self, text: str, *,
               on_unknown: Literal["unk", "raise"] = "unk") -> list[int]:
        """Token ids of a text.

        Args:
          text: any text.
          on_unknown: "unk" maps each uncovered piece to `<unk>` (a single space
            before it is kept as the whitespace token); "raise" raises a
            ValueError naming the uncovered pieces.

        Returns:
          The ids; `decode` gives `text` back exactly when `unknown_words(text)`
          is empty.
        """
        if on_unknown not in ("unk", "raise"):
            raise ValueError(f"WordTokenizer.encode: on_unknown must be 'unk' or 'raise', "
                             f"got {on_unknown!r}")
        out: list[int] = []
        unknown: list[str] = []
        for piece in _PIECE_RE.findall(text):
            ids = self._encode_piece(piece)
            if ids is not None:
                out += ids
                continue
            unknown.append(piece.lstrip(" ") or piece)
            if len(piece) > 1 and piece[0] == " ":
                out.append(self._ids[" "])
            out.append(self._special.unk)
        if unknown and on_unknown == "raise":
            raise ValueError(f"WordTokenizer.encode: {len(unknown)} uncovered piece(s) "
                             f"{sorted(set(unknown))[:20]} in text {text[:80]!r}")
        return out

    def unknown_words(self, text: str) -> list[str]:
        """The pieces of `text` that encode to `<unk>`, in order (empty when covered)."""
        return [piece.lstrip(" ") or piece for piece in _PIECE_RE.findall(text)
                if self._encode_piece(piece) is None]

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of a sequence of ids.

        Args:
          ids: token ids in `[0, vocab_size)`.
          skip_special: drop the special tokens (`<bos>`, `<eoa>`, `<obs>`, ...)
            instead of writing their names. `<cap>` and `<upper>` are never
            written: they change the case of the next token (and are dropped
            when no token follows).

        Returns:
          The text; `decode(encode(text)) == text` for every covered text.
        """
        parts: list[str] = []
        case = None
        for token_id in ids:
            token_id = int(token_id)
            if not 0 <= token_id < len(self._tokens):
                raise ValueError(f"WordTokenizer.decode: id {token_id} out of range "
                                 f"[0, {len(self._tokens)})")
            if token_id in (self._cap, self._upper):
                case = token_id
                continue
            token = self._tokens[token_id]
            if token_id in self._choice_text:
                parts.append(self._choice_text[token_id])
            elif token_id < self._num_special:
                if not skip_special:
                    parts.append(token)
            elif case == self._cap:
                lead = len(token) - len(token.lstrip(" "))
                parts.append(token[:lead] + token[lead:lead + 1].upper() + token[lead + 1:])
            elif case == self._upper:
                parts.append(token.upper())
            else:
                parts.append(token)
            case = None
        return "".join(parts)

    def to_json(self) -> str:
        """The tokenizer as a JSON string (format name, version, tokens in id order)."""
        return json.dumps({"format": _FORMAT, "version": _VERSION, "tokens": self._tokens},
                          ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "WordTokenizer":
        """Rebuilds a tokenizer from `to_json`'s output."""
        data = json.loads(text)
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ValueError(f"WordTokenizer.from_json: expected format {_FORMAT!r} version "
                             f"{_VERSION}, got {data.get('format')!r} version "
                             f"{data.get('version')!r}")
        return cls(data["tokens"])

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer to a JSON file."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WordTokenizer":
        """Reads a tokenizer written by `save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WordTokenizer) and self._tokens == other._tokens

    def __hash__(self) -> int:
        return hash(tuple(self._tokens))

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"


def count_unknown(tokenizer: Tokenizer, ids: Sequence[int]) -> int:
    """The number of `<unk>` ids in `ids` (works for any `Tokenizer`)."""
    unk = tokenizer.special.unk
    return sum(1 for i in ids if int(i) == unk)
