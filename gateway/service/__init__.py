"""service: the protocol-independent work of a request: canonicalization (the only importer of ``rules``),
the model registry and prefix key, the pipeline that opens a backend stream and records each request once,
stats, metrics and the request log. No HTTP here: the ``http`` layer hands in what it needs.
"""
