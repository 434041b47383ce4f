"""Qwen2 / Qwen3 checkpoints from a local folder, as tunix models, with their logits.

A folder in Hugging Face's layout (`config.json`, one or more `*.safetensors`,
`tokenizer.json`, `tokenizer_config.json` with the chat template) is read
without the network: stepcredit builds tunix's model configuration from
`config.json` (tunix's automatic loader looks the model up on the hub) and
loads the weights with tunix's safetensors loader.

Checked at the boundary, each with a message naming the field: the family
(`model_type` "qwen2" or "qwen3"), RoPE (`rope_theta`, or newer transformers'
`rope_parameters.rope_theta`; scaled RoPE is refused), and tunix 0.1.7's Qwen3
rule that RoPE's base is 1e6 (its attention ignores the configured base).

References: Qwen2 (arXiv 2407.10671), Qwen3 (arXiv 2505.09388); tunix
`models/qwen2`, `models/qwen3`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Family = Literal["qwen2", "qwen3"]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# tunix 0.1.7's Qwen3 attention calls apply_rope without the configured base.
_QWEN3_ROPE_BASE = 1_000_000


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the tunix model, its tokenizer, and what it was built from.

    Attributes:
      model: the tunix `Qwen2` / `Qwen3` module (Flax NNX).
      tokenizer: a `transformers.PreTrainedTokenizerFast` read from the folder.
      family: "qwen2" or "qwen3".
      config: tunix's `ModelConfig`.
      mesh: the device mesh the parameters live on.
    """

    model: Any
    tokenizer: Any
    family: Family
    config: Any
    mesh: jax.sharding.Mesh


def _read_config(model_dir: pathlib.Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_dir {str(model_dir)!r} has no config.json")
    with open(path) as f:
        return json.load(f)


_REQUIRED_KEYS = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size",
                  "num_attention_heads", "rms_norm_eps")


def _rope_theta(config: dict) -> float:
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"config.json: rope type {kind!r}; only unscaled RoPE ('default') is supported")
    theta = config.get("rope_theta", parameters.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


def family_of(config: dict) -> Family:
    """"qwen2" or "qwen3" from `config.json`'s `model_type`."""
    family = config.get("model_type")
    if family not in ("qwen2", "qwen3"):
        raise ValueError(f"config.json: model_type {family!r}; stepcredit loads 'qwen2' and 'qwen3'")
    return family


def model_config(model_dir: str | pathlib.Path, *, dtype: str = "float32"):
    """tunix's `ModelConfig` for the checkpoint in `model_dir`, built from its `config.json`.

    Args:
      model_dir: the folder.
      dtype: "float32" or "bfloat16", for both activations and parameters.

    Returns:
      `(family, ModelConfig)`.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; it must be one of {sorted(_DTYPES)}")
    config = _read_config(pathlib.Path(model_dir))
    family = family_of(config)
    theta = _rope_theta(config)
    if family == "qwen3" and theta != _QWEN3_ROPE_BASE:
        raise ValueError(f"config.json: rope_theta {theta:g}; tunix 0.1.7's Qwen3 attention always "
                         f"uses {_QWEN3_ROPE_BASE:g} (it does not pass the configured base)")
    if family == "qwen3":
        from tunix.models.qwen3 import model as tunix_model
    else:
        from tunix.models.qwen2 import model as tunix_model
    if theta != int(theta):
        raise ValueError(f"config.json: rope_theta {theta!r}; tunix 0.1.7 takes a whole-number RoPE base")
    missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
    if missing:
        raise ValueError(f"config.json: {', '.join(missing)} missing or null")
    heads = config["num_attention_heads"]
    fields = dict(
        num_layers=config["num_hidden_layers"], vocab_size=config["vocab_size"],
        embed_dim=config["hidden_size"], hidden_dim=config["intermediate_size"], num_heads=heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        # null (as some exporters write) means what absent means: one key-value head per head
        num_kv_heads=config.get("num_key_value_heads") or heads, rope_theta=int(theta),
        norm_eps=config["rms_norm_eps"], use_tied_embedding=bool(config.get("tie_word_embeddings")),
        dtype=_DTYPES[dtype], param_dtype=_DTYPES[dtype])
    return family, tunix_model.ModelConfig(**fields)


def default_mesh() -> jax.sharding.Mesh:
    """All devices on tunix's ("fsdp", "tp") axes, parameters sharded over "fsdp".

    Auto axis types: jax 0.10's default (Explicit) breaks tunix's embedding lookup.
    """
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((jax.device_count(), 1), ("fsdp", "tp"), axis_types=auto)


def load(model_dir: str | pathlib.Path, *, dtype: str = "float32",
         mesh: jax.sharding.Mesh | None = None) -> Checkpoint:
    """Loads a Qwen2 / Qwen3 folder as a tunix model and its tokenizer, offline.

    Args:
      model_dir: folder with `config.json`, `*.safetensors`, `tokenizer.json`.
      dtype: "float32" or "bfloat16".
      mesh: where the parameters go; default `default_mesh()`.

    Returns:
      A `Checkpoint`.
    """
    from transformers import PreTrainedTokenizerFast

    folder = pathlib.Path(model_dir)
    family, config = model_config(folder, dtype=dtype)
    if not list(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"model_dir {str(folder)!r} has no *.safetensors")
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"model_dir {str(folder)!r} has no tokenizer.json")
    if family == "qwen3":
        from tunix.models.qwen3 import params
    else:
        from tunix.models.qwen2 import params
    mesh = mesh or default_mesh()
    with jax.set_mesh(mesh):
        model = params.create_model_from_safe_tensors(str(folder), config, mesh, dtype=config.dtype)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    return Checkpoint(model, tokenizer, family, config, mesh)


def attention_inputs(mask: np.ndarray | jax.Array):
    """Positions and the causal attention mask of left- or right-padded rows.

    Args:
      mask: `[B, L]` bool, True on real tokens.

    Returns:
      `(positions [B, L] int32, attention [B, L, L] bool)`: a token's position
      counts the real tokens before it; it attends to real tokens at or
      before it.
    """
    mask = jnp.asarray(mask, bool)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    length = mask.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    return positions, causal[None] & mask[:, None, :] & mask[:, :, None]


def logits(checkpoint: Checkpoint, tokens, mask) -> jax.Array:
    """Next-token logits of every position, `[B, L, vocab]` float32.

    Args:
      checkpoint: a loaded `Checkpoint`.
      tokens: `[B, L]` int token ids; mask: `[B, L]` bool, True on real tokens.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tuple(np.shape(mask)) != tuple(tokens.shape):
        raise ValueError(f"logits: tokens has shape {tuple(tokens.shape)} and mask "
                         f"{tuple(np.shape(mask))}; both must be [B, L]")
    with jax.set_mesh(checkpoint.mesh):
        return _forward(checkpoint.model, tokens, jnp.asarray(mask, bool))


@nnx.jit
def _forward(model, tokens, mask):
    # One compiled call: op-by-op dispatch of a whole model is slow (and has aborted the
    # process inside jaxlib on CPU under pytest-xdist).
    positions, attention = attention_inputs(mask)
    out, _ = model(tokens, positions, None, attention)
    return out.astype(jnp.float32)
