"""protocols: OpenAI and Anthropic bodies <-> core types, as pure functions testable without a server
(``openai/``: parse, render; ``anthropic/``: validate, parse, prompt, strip, render, stream, breakpoints,
boundaries). Imports only ``core`` and ``config``; knows nothing of HTTP or of upstream calls.
"""
