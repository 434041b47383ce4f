"""Qwen2 / Qwen3 folders loaded through tunix: logits equal transformers' on the same weights."""

import json

import numpy as np
import pytest

pytest.importorskip("tunix", reason="the llm tests need the tunix extra")

from stepcredit.llm import checkpoint  # noqa: E402
from tests.llm.checkpoints import reference_logits, write  # noqa: E402


def batch(seed=0, size=3, length=12):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, 60, (size, length))
    mask = np.ones((size, length), bool)
    mask[1, :4] = False  # left padding
    mask[2, -3:] = False  # right padding
    return tokens, mask


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers(tmp_path, family, tied):
    model = write(tmp_path, family, tied=tied)
    loaded = checkpoint.load(tmp_path)
    assert loaded.family == family and loaded.config.use_tied_embedding == tied
    tokens, mask = batch()
    ours = np.asarray(checkpoint.logits(loaded, tokens, mask))
    np.testing.assert_allclose(ours[mask], reference_logits(model, tokens, mask)[mask], atol=2e-5)


def test_bfloat16_and_the_legacy_rope_key(tmp_path):
    model = write(tmp_path, "qwen2", rope_theta=10_000.0, legacy_rope_key=True)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    loaded = checkpoint.load(tmp_path, dtype="bfloat16")
    assert loaded.config.rope_theta == 10_000
    tokens, mask = batch(1)
    ours = np.asarray(checkpoint.logits(loaded, tokens, mask))
    np.testing.assert_allclose(ours[mask], reference_logits(model, tokens, mask)[mask], atol=0.1)


def test_refusals_name_the_field(tmp_path):
    write(tmp_path, "qwen3", rope_theta=10_000.0)
    with pytest.raises(ValueError, match="rope_theta 10000; tunix 0.1.7's Qwen3"):
        checkpoint.load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        checkpoint.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        checkpoint.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="dtype='float16'"):
        checkpoint.model_config(tmp_path, dtype="float16")
    config["model_type"] = "qwen2"
    for key, value, message in (("rope_theta", 10_000.5, "rope_theta 10000.5; tunix 0.1.7 takes a whole"),
                                ("num_key_value_heads", None, None),
                                ("rms_norm_eps", None, "rms_norm_eps missing or null")):
        changed = dict(config, **{key: value})
        (tmp_path / "config.json").write_text(json.dumps(changed))
        if message is None:
            heads = checkpoint.model_config(tmp_path)[1]
            assert heads.num_kv_heads == config["num_attention_heads"]
        else:
            with pytest.raises(ValueError, match=message):
                checkpoint.model_config(tmp_path)
