"""Tools for a trained run: ``generation`` and ``lm_chat`` (``pockengine generate``),
``run_eval`` and ``lm_eval`` (``pockengine evaluate``), ``gguf_lora`` (the adapter as a
GGUF LoRA)."""
