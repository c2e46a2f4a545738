"""transport: protocol-blind HTTP to upstreams: the shared httpx client, one call with retries before the
first byte, failure kinds, key and URL redaction, the SSE parser and streaming response, the prefix-affinity
replica ring. Imports only ``core`` and ``config``; never a protocol module.
"""
