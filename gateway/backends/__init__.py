"""backends: what serves a request: the ``Backend`` base (with its capabilities), the embedded engine,
OpenAI-compatible and Anthropic upstreams, and the config entry -> backend table. Only ``backends/embedded``
reaches the torch side of ``engine`` (when it starts).
"""
