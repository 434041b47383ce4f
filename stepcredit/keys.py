"""Host-side keys and dense ids: stable 64-bit keys of values, and dense int32 ids.

Two jobs, shared by the anchors, the data checks, offline credit and the verl
adapters:

  - `stable_key` / `stable_keys`: a 64-bit key of any value built from
    strings, bytes, numbers, NumPy arrays and containers of these: blake2b of
    a canonical byte encoding, equal across processes and runs (Python's
    `hash` is salted per process, so it is never used).
  - `dense_ids`: equal values, equal ids in [0, count), numbered either in
    sorted order of the values or in order of first appearance.

Plain Python and NumPy; nothing here is traced (JAX's traced counterpart is
`stepcredit.advantages.dense_group_ids`). The module imports nothing else of
stepcredit, so a key can be checked in a bare process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence, Set
from typing import Any, Literal

import numpy as np

Order = Literal["sorted", "first"]


def _length(n: int) -> bytes:
    return struct.pack("<Q", n)


def _encode(x: Any, out: list[bytes]) -> None:
    """Appends a canonical, type-tagged, length-prefixed byte encoding of `x` to `out`."""
    if x is None:
        out.append(b"N")
    elif isinstance(x, (bool, np.bool_)):
        out.append(b"T" if x else b"F")
    elif isinstance(x, (int, np.integer)):
        digits = str(int(x)).encode()
        out += [b"i", _length(len(digits)), digits]
    elif isinstance(x, (float, np.floating)):
        out += [b"f", struct.pack("<d", float(x))]
    elif isinstance(x, str):
        data = x.encode("utf-8")
        out += [b"s", _length(len(data)), data]
    elif isinstance(x, (bytes, bytearray, memoryview)):
        data = bytes(x)
        out += [b"b", _length(len(data)), data]
    elif isinstance(x, np.ndarray) or hasattr(x, "__array__"):
        _encode_array(np.asarray(x), out)
    elif isinstance(x, Mapping):
        items = sorted(_encoded(k) + _encoded(v) for k, v in x.items())
        out += [b"d", _length(len(items))] + items
    elif isinstance(x, Set):
        items = sorted(_encoded(v) for v in x)
        out += [b"e", _length(len(items))] + items
    elif isinstance(x, Sequence):
        out += [b"l", _length(len(x))]
        for item in x:
            _encode(item, out)
    else:
        raise TypeError(f"stable_key: cannot encode an object of type {type(x).__name__}; "
                        f"use str, bytes, numbers, NumPy arrays, or lists, tuples, dicts and "
                        f"sets of these")


def _encode_array(x: np.ndarray, out: list[bytes]) -> None:
    if x.dtype == object:
        out += [b"o", _length(x.ndim)] + [_length(n) for n in x.shape]
        for item in x.reshape(-1):
            _encode(item, out)
        return
    little = x.astype(x.dtype.newbyteorder("<"), copy=False)
    dtype = little.dtype.str.encode()
    data = np.ascontiguousarray(little).tobytes()
    out += [b"a", _length(len(dtype)), dtype, _length(x.ndim)]
    out += [_length(n) for n in x.shape] + [_length(len(data)), data]


def _encoded(x: Any) -> bytes:
    out: list[bytes] = []
    _encode(x, out)
    return b"".join(out)


def stable_key(x: Any) -> int:
    """A stable 64-bit key of a value (an observation, a uid, a trajectory id).

    The key is the 8-byte blake2b digest of a canonical encoding: the type is
    part of it ("1", 1, 1.0 and True differ; a list equals the tuple of its
    items, as in verl-agent's `to_hashable`), strings are UTF-8, arrays
    contribute their dtype, shape and bytes (little-endian, C order), mappings
    and sets are sorted, and NumPy scalars encode as the Python number of their
    value. Equal values give equal keys in every process and on every run.

    Args:
      x: a string, bytes, number, None, NumPy array (or anything with
        `__array__`), or a list, tuple, dict or set of these.

    Returns:
      An int in [0, 2**64).

    Raises:
      TypeError: for an object of another type (naming it).

    Example: `stable_key("You are in the kitchen.")` is 3991932235397279594 in
    every Python process; `stable_key(np.zeros(3))` differs from
    `stable_key(np.zeros(3, np.float32))`.
    """
    digest = hashlib.blake2b(_encoded(x), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def stable_keys(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """`stable_key` of each of N values, as an `[N]` uint64 array.

    Args:
      values: N values (a sequence, or a 1-D array, e.g. of dtype object).

    Returns:
      `[N]` uint64 keys, in the order of `values`.
    """
    return np.fromiter((stable_key(v) for v in values), np.uint64, count=len(values))


def dense_ids(values: Sequence[Any] | np.ndarray, *, order: Order = "sorted") -> tuple[np.ndarray, int]:
    """Dense int32 ids of N values: equal values, equal ids in [0, count).

    Args:
      values: N numbers or strings (a sequence or a 1-D array; an object array
        must hold mutually comparable values). Key other objects (arrays,
        dicts, mixed types) with `stable_keys` first.
      order: how the distinct values are numbered. "sorted": by rank of the
        value (`np.unique`), so the ids depend only on the set of values, not
        on their order; "first": in order of first appearance (as
        `pandas.factorize`), so the first value gets 0 and ids increase along
        the array. NaNs count as one value, not as missing.

    Returns:
      `(ids, count)`: `[N]` int32 ids and the number of distinct values.

    Raises:
      ValueError: an unknown `order`, or `values` not 1-D.

    Example: `dense_ids(["b", "a", "b", "c"])` is `([1, 0, 1, 2], 3)`;
    with `order="first"` it is `([0, 1, 0, 2], 3)`.
    """
    if order not in ("sorted", "first"):
        raise ValueError(f"dense_ids: order={order!r}; it must be 'sorted' or 'first'")
    values = np.asarray(values)
    if values.ndim != 1:
        raise ValueError(f"dense_ids: values has shape {values.shape}; it must be 1-D [N]")
    if order == "sorted":
        uniques, inverse = np.unique(values, return_inverse=True)
        return inverse.reshape(-1).astype(np.int32), len(uniques)
    uniques, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    rank = np.empty(len(uniques), np.int64)
    rank[np.argsort(first)] = np.arange(len(uniques))
    return rank[inverse.reshape(-1)].astype(np.int32), len(uniques)
