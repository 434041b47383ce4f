"""Language-model policies from local checkpoint folders (the `[llm]` extra: tunix, transformers).

  - `checkpoint`: a Qwen2 / Qwen3 folder (`config.json`, `*.safetensors`,
    `tokenizer.json`) as a tunix model, its tokenizer, and its logits.
  - `generate`: sampling through tunix's sampler from prompt ids, with a
    seed per call.
  - `rollout`: groups of episodes in a stepcredit environment as token-exact
    step records.
  - `learn`: training the model on those records with any registered estimator
    (with a critic, an implicit PRM or a progress estimator as further copies
    of the model where the estimator reads one), fully or with LoRA (`lora`).
  - `critic`, `lora`, `vine`, `tree`: the value-head copies, the adapters,
    VinePPO's continuations and Tree-GRPO's forests.
  - `chat`: step prompts as chat messages, rendered with the tokenizer's chat
    template, and actions parsed from the model's text.
"""
