"""prefixgate's embedded inference engine.

Loads Llama-family decoders (GGUF or Hugging Face folders), renders chat templates, and serves them from a
paged KV cache whose full blocks are shared between requests by prefix. The KV side is ``block_pool``
(blocks, reference counts, LRU eviction) under ``kv_cache_manager`` (block tables and the prefix cache);
a request goes through ``input_processor`` (checks, engine request), ``scheduler``, ``model_runner`` and
``output_processor`` (detokenize, stop checks, finish), stepped by ``llm_engine`` and driven from a thread
by ``async_engine``. ``api`` holds the torch-free types callers use.

This package knows nothing of HTTP and nothing of ``rules``.
"""
