"""LoRA adapters for a chat-model policy, as pure functions of parameter trees.

Low-rank adaptation (Hu et al., arXiv 2106.09685) freezes each adapted kernel
W and learns a low-rank change:

    W' = W + (alpha / r) A B,   A: [*in, r],  B: [r, *out],  B = 0 at the start

so the adapted model starts as the pretrained one. The adapted kernels are
every parameter of the decoder layers with two or more dimensions, that is the
attention's q, k, v and output projections and the MLP's gate, up and down
projections (verl's `target_modules="all-linear"`); the embeddings, the output
head, norms and biases stay frozen. A kernel's input dimensions are its first
when it starts with the model's hidden size (q, k, v: `[D, heads, head_dim]`;
gate and up: `[D, F]`) and all but its last otherwise (output projection:
`[heads, head_dim, D]`; down: `[F, D]`). A is drawn uniformly from
[-1/sqrt(fan_in), 1/sqrt(fan_in)] (PEFT's default), B is 0.

Adapters are a dict from a kernel's path in the parameter tree
(`jax.tree_util.keystr`) to {"a", "b"}, float32; `merged` applies them.
tunix 0.1.7's Qwen kernels cast their weight before the einsum, which hides it
from qwix's LoRA interception, hence these functions on the tree itself.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp


def _input_dims(shape: tuple[int, ...], hidden_size: int) -> int:
    return 1 if shape[0] == hidden_size else len(shape) - 1


def _adapted(params) -> list[tuple[str, jax.Array]]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves
            if leaf.ndim >= 2 and "'layers'" in jax.tree_util.keystr(path)]


def init(params, *, rank: int, hidden_size: int, key: jax.Array) -> dict[str, dict[str, jax.Array]]:
    """Adapters of rank `rank` for every adapted kernel of `params` (B = 0: W' = W).

    Args:
      params: the model's parameter tree (`nnx.split(model, nnx.Param, ...)[1]`).
      rank: r >= 1.
      hidden_size: D, the model's hidden size (which sets a kernel's input dims).
      key: seeds A.
    """
    if rank < 1:
        raise ValueError(f"lora.init: rank={rank}; it must be >= 1")
    kernels = _adapted(params)
    if not kernels:
        raise ValueError("lora.init: params hold no decoder-layer kernel to adapt")
    adapters = {}
    for (name, kernel), subkey in zip(kernels, jax.random.split(key, len(kernels))):
        split = _input_dims(kernel.shape, hidden_size)
        fan_in = math.prod(kernel.shape[:split])
        bound = 1.0 / math.sqrt(fan_in)
        adapters[name] = {
            "a": jax.random.uniform(subkey, kernel.shape[:split] + (rank,), jnp.float32, -bound, bound),
            "b": jnp.zeros((rank,) + kernel.shape[split:], jnp.float32)}
    return adapters


def merged(params, adapters: dict[str, dict[str, Any]], *, scale: float):
    """`params` with W + scale A B at every adapted kernel (scale = alpha / r), in W's dtype."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in leaves:
        adapter = adapters.get(jax.tree_util.keystr(path))
        if adapter is not None:
            delta = jnp.tensordot(adapter["a"], adapter["b"], axes=1)
            leaf = (leaf.astype(jnp.float32) + scale * delta).astype(leaf.dtype)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


__all__: Sequence[str] = ("init", "merged")
