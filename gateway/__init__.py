"""The prefixgate HTTP gateway, in layers (lowest first; a layer imports only itself and lower layers)::

    core -> config -> {protocols, transport} -> backends -> service -> http -> cli

``tests/test_layers.py`` checks the order; docs/architecture.md follows a request through it.
"""
