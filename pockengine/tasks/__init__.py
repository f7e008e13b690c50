"""What a fine-tune trains, on what, and how it is scored: its options (``config``), the
``Task`` a recipe builds (``task``, ``recipes``, ``recipe_table``), the models (``models``,
``model_files``, ``vision``, ``causal_lm``, ``gguf``, ``lm_kind``), the data (``data``; your
own LLM's: ``lm_data``, ``lm_pack``, ``lm_task``) and the evaluation (``metrics``)."""
