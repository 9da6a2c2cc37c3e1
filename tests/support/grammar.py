"""The default model's vocabulary as the structured-output tests compile grammars for it (SmolLM2's)."""

VOCAB = 49152
EOS = 2  # <|im_end|>
