"""core: the gateway's own types and small pure helpers: the request (``ChatRequest``) and event
(``Delta``, ``Finish``) types, API errors, the prefixgate headers, JSON kind names and compact JSON, SSE event
encoding, token estimation. Imports nothing above it, and no server or HTTP client library.
"""
