"""prefixgate's embedded inference engine.

Loads Llama-family decoders (GGUF or Hugging Face folders), renders chat templates, and serves them from a
paged KV cache whose full blocks are shared between requests by prefix (see ``block_pool``,
``prefix_cache``, ``kv_cache_manager``, ``scheduler``, ``model_runner``, ``async_engine``).

This package knows nothing of HTTP and nothing of ``rules``.
"""
