"""Backends a model name can route to: the embedded engine and remote upstreams."""
