"""Array plumbing shared by the framework adapters: tensors in and out, uids, step layouts.

Host-side and framework-neutral: torch is imported only when a tensor is
given, NumPy arrays pass straight through, and nothing here is traced.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stepcredit.keys import dense_ids, stable_keys


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def to_jax(x: Any) -> jnp.ndarray:
    """A NumPy array, list or torch tensor as a JAX array (DLPack without a copy where it can)."""
    if is_torch(x):
        import jax.dlpack
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:  # NumPy has no bfloat16; DLPack carries it
            x = x.float()
        try:
            return jax.dlpack.from_dlpack(x.contiguous())
        except (RuntimeError, TypeError, ValueError, BufferError):
            return jnp.asarray(x.cpu().numpy())
    return jnp.asarray(x)


def like(x: jnp.ndarray, reference: Any, dtype=None):
    """`x` as the type of `reference`: a torch tensor on its device and dtype, or a NumPy array."""
    if is_torch(reference):
        import torch

        out = torch.from_dlpack(x)
        return out.to(device=reference.device, dtype=dtype or reference.dtype)
    return np.array(x, dtype=dtype or np.asarray(reference).dtype)  # writable, as verl's tensors


def host(x: Any) -> np.ndarray:
    if is_torch(x):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def dense(uids: Any, name: str, size: int) -> np.ndarray:
    """Dense int32 ids of `size` uids in order of first appearance (equal uids, equal ids).

    Object arrays (strings, arrays, lists or dicts of these) are compared by
    `stepcredit.keys.stable_key`, so 1 and 1.0 are different uids.
    """
    if uids is None:
        raise ValueError(f"{name} is None; it must hold one uid per row")
    values = host(uids).reshape(-1)
    if values.shape[0] != size:
        raise ValueError(f"{name} has {values.shape[0]} entries but the batch has {size} rows")
    if values.dtype == object:
        try:
            values = stable_keys(values)
        except TypeError as error:
            raise TypeError(f"{name}: {error}") from None
    return dense_ids(values, order="first")[0]


def token_rows(token_level_rewards, response_mask, fn: str, *, name: str = "token_level_rewards"):
    """Checked `(bs, response_length)` float32 values (named `name` in errors) and bool mask."""
    rewards = to_jax(token_level_rewards)
    mask = to_jax(response_mask)
    if rewards.ndim != 2 or rewards.shape != mask.shape:
        raise ValueError(f"{fn}: {name} has shape {tuple(rewards.shape)} and "
                         f"response_mask {tuple(mask.shape)}; both must be (bs, response_length)")
    return rewards.astype(jnp.float32), mask.astype(bool)


def mask_rows(response_mask, fn: str) -> jnp.ndarray:
    """A checked `(bs, response_length)` bool mask."""
    mask = to_jax(response_mask)
    if mask.ndim != 2:
        raise ValueError(f"{fn}: response_mask has shape {tuple(mask.shape)}; it must be "
                         f"(bs, response_length)")
    return mask.astype(bool)


def token_matrix(x, name: str, shape, fn: str) -> jnp.ndarray:
    """A `(bs, response_length)` float32 array checked against `shape`."""
    if x is None:
        raise ValueError(f"{fn}: {name} is None; it must be (bs, response_length) = {tuple(shape)}")
    array = to_jax(x)
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} has shape {tuple(array.shape)}; it must be "
                         f"(bs, response_length) = {tuple(shape)}")
    return array.astype(jnp.float32)


def row_vector(x, name: str, size: int, fn: str) -> jnp.ndarray:
    """A `(bs,)` float32 array, or a `(bs, 1)` one flattened."""
    if x is None:
        raise ValueError(f"{fn}: {name} is None; it must be (bs,) = ({size},)")
    array = to_jax(x)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if tuple(array.shape) != (size,):
        raise ValueError(f"{fn}: {name} has shape {tuple(array.shape)}; it must be (bs,) = ({size},)"
                         + (" (a (bs, response_length) array of token scores belongs in "
                            "rm_scores / token_level_rewards)" if array.ndim == 2 else ""))
    return array.astype(jnp.float32)


def row_sums(rewards: jnp.ndarray, mask: jnp.ndarray | None) -> jnp.ndarray:
    """Each row's reward sum: over all tokens (`mask=None`, verl's rule) or over masked-in ones."""
    if mask is None:
        return jnp.sum(rewards, axis=1)
    return jnp.sum(jnp.where(mask, rewards, 0.0), axis=1)


def broadcast(per_row: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    return jnp.where(mask, per_row[:, None], 0.0)


def first_rows(ids: np.ndarray) -> np.ndarray:
    """The first row (in batch order) of each dense id, `[count]`."""
    first = np.full(int(ids.max(initial=-1)) + 1, -1)
    first[ids[::-1]] = np.arange(ids.shape[0])[::-1]
    return first


def step_indices(values, name: str, size: int, fn: str) -> np.ndarray:
    """`[bs]` int64 steps of the rows, checked: one per row, whole numbers (1.0 passes, 1.5 does not)."""
    raw = host(values).reshape(-1)
    if raw.shape[0] != size:
        raise ValueError(f"{fn}: {name} has {raw.shape[0]} entries for {size} rows")
    # Text such as "1" would convert to a number; verl's object arrays of ints must.
    text = [v for v in raw.tolist() if isinstance(v, (str, bytes))] if raw.dtype.kind in "USO" else []
    if text:
        raise TypeError(f"{fn}: {name} holds text such as {text[0]!r}; steps are numbers")
    try:
        numbers = raw.astype(np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} holds non-numeric values such as {raw[0]!r}") from None
    whole = np.isfinite(numbers) & (numbers == np.round(numbers))
    if not whole.all():
        row = int(np.flatnonzero(~whole)[0])
        raise ValueError(f"{fn}: {name} holds {float(numbers[row])!r} at row {row}; steps are whole numbers")
    return numbers.astype(np.int64)


class StepLayout:
    """Step rows -> `[num_trajectories, T]` step arrays, and back.

    Rows sharing a trajectory uid form one trajectory; `step_index` gives each
    row's step (0, 1, ..., n - 1, none missing or repeated). With
    `step_index=None` a trajectory's rows are its steps in batch order (the
    rule of code that relies on rollout order).
    """

    def __init__(self, traj_index, step_index, size: int, fn: str, *, traj_name="traj_index",
                 step_name="step_index"):
        self.traj = dense(traj_index, traj_name, size)
        if step_index is None:
            self.step = _order_in_batch(self.traj)
        else:
            self.step = step_indices(step_index, step_name, size, fn)
        self.count = int(self.traj.max(initial=-1)) + 1
        self.length = int(self.step.max(initial=-1)) + 1
        if size and self.step.min() < 0:
            raise ValueError(f"{fn}: {step_name} holds {self.step.min()}; steps start at 0")
        seen = np.zeros((self.count, self.length), np.int32)
        np.add.at(seen, (self.traj, self.step), 1)
        uids = host(traj_index).reshape(-1)
        if (seen > 1).any():
            b, t = np.argwhere(seen > 1)[0]
            raise ValueError(f"{fn}: trajectory {uids[self.traj == b][0]!r} has step {t} on two rows "
                             f"({step_name})")
        self.mask = seen == 1
        lengths = self.mask.sum(axis=1)
        gaps = (self.mask != (np.arange(self.length) < lengths[:, None])).any(axis=1)
        if gaps.any():
            b = int(np.flatnonzero(gaps)[0])
            raise ValueError(f"{fn}: trajectory {uids[self.traj == b][0]!r} has steps "
                             f"{sorted(self.step[self.traj == b].tolist())} ({step_name}); they must "
                             f"run 0, 1, ..., n - 1")

    def steps(self, per_row: jnp.ndarray) -> jnp.ndarray:
        return jnp.zeros((self.count, self.length), per_row.dtype).at[self.traj, self.step].set(per_row)

    def rows(self, per_step: jnp.ndarray) -> jnp.ndarray:
        return per_step[self.traj, self.step]


def _order_in_batch(traj: np.ndarray) -> np.ndarray:
    """Each row's rank among its trajectory's rows, in batch order."""
    order = np.argsort(traj, kind="stable")
    starts = np.searchsorted(traj[order], traj[order])
    rank = np.empty_like(traj, dtype=np.int64)
    rank[order] = np.arange(traj.shape[0]) - starts
    return rank


def read(container, key: str, fn: str, *, required: bool = True):
    """`data.batch[key]` or `data.non_tensor_batch[key]` of a verl `DataProto` (or mappings so named)."""
    for part in ("batch", "non_tensor_batch"):
        store = getattr(container, part, None)
        if store is not None and key in store.keys():
            return store[key]
    if required:
        raise KeyError(f"{fn}: the batch has no {key!r} (neither data.batch nor data.non_tensor_batch)")
    return None


def number(fn: str, name: str, value) -> float:
    """A hyperparameter as a finite Python float, or one line naming `fn` and `name`.

    Accepts what trainers' configs hold: Python and NumPy numbers, one-element
    tensors and numeric strings (YAML reads "1e-6" as a string); a bool, None
    or an array of several elements is refused, as is a NaN or an infinity.
    """
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{fn}: {name} is traced (the adapters run outside jax.jit); pass a "
                         "number")
    try:
        array = host(value)
        if array.size != 1 or array.dtype == bool:
            raise TypeError
        out = float(array.reshape(()).item())
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{fn}: {name}={value!r}; it must be a number") from None
    if not math.isfinite(out):
        raise ValueError(f"{fn}: {name}={out}; it must be finite")
    return out


def setting(config, key: str, default=None):
    """`config.key` of a verl AlgoConfig, an OmegaConf node or a dict; `default` when absent."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (KeyError, AttributeError):
            return default
    return getattr(config, key, default)


def normalize_by_members(scores: jnp.ndarray, groups: np.ndarray, members: np.ndarray,
                         member_scores: jnp.ndarray | None = None, *, rule: str, eps: float = 1e-6,
                         singleton: str = "raw") -> jnp.ndarray:
    """Every row's score against statistics of its group's member rows (the forks' dedup rules).

    verl-agent, ARLArena and iStar take a group's mean and std over chosen
    rows (every step row, one row per trajectory, or per-trajectory means) and
    then normalise EVERY row's own score with them. With m_g, sd_g (unbiased)
    and n_g over the members of group g:

        rule "std":    (s_i - m_g) / (sd_g + eps)
        rule "mean":   s_i - m_g
        rule "rloo":   n_g / (n_g - 1) (s_i - m_g)

    A group with one member uses m = 0, sd = 1 (singleton "raw": verl's rule,
    so "rloo" keeps s_i) or gives 0 (singleton "zero": GiGPO's step groups).

    Args:
      scores: `[bs]` row scores; groups: `[bs]` dense group ids.
      members: `[M]` row indices of the members; member_scores: `[M]` their
        scores (default `scores[members]`).
    """
    groups = jnp.asarray(groups)
    count = int(groups.max(initial=-1)) + 1 if groups.size else 0
    values = scores[members] if member_scores is None else member_scores
    member_groups = groups[np.asarray(members)]
    n = jnp.zeros(count).at[member_groups].add(1.0)
    mean = jnp.zeros(count).at[member_groups].add(values) / jnp.maximum(n, 1.0)
    squares = jnp.zeros(count).at[member_groups].add((values - mean[member_groups]) ** 2)
    sd = jnp.sqrt(squares / jnp.maximum(n - 1.0, 1.0))
    alone = n[groups] <= 1.0
    centre = jnp.where(alone, 0.0, mean[groups])
    if rule == "std":
        out = (scores - centre) / (jnp.where(alone, 1.0, sd[groups]) + eps)
    elif rule == "mean":
        out = scores - centre
    elif rule == "rloo":
        out = jnp.where(alone, scores, (scores - centre) * n[groups] / jnp.maximum(n[groups] - 1.0, 1.0))
    else:
        raise ValueError(f"normalize_by_members: rule={rule!r}; it must be 'std', 'mean' or 'rloo'")
    if singleton == "zero":
        out = jnp.where(alone, 0.0, out)
    return out.astype(jnp.float32)


def trajectory_pairs(groups: np.ndarray, traj: np.ndarray) -> np.ndarray:
    """Dense ids of each row's (group, trajectory) pair, in order of first appearance."""
    return dense_ids(groups.astype(np.int64) * (int(traj.max(initial=0)) + 1) + traj, order="first")[0]


def trajectory_members(groups: np.ndarray, traj: np.ndarray) -> np.ndarray:
    """The first row, in batch order, of each (group, trajectory) pair."""
    return first_rows(trajectory_pairs(groups, traj))
