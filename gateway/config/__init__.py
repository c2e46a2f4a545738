"""config: the gateway's config: typed schema (one class per backend kind), price tables, and YAML
loading with errors that name file, key and expectation. Imports only ``core`` (and ``engine.api``).
"""
