"""Prompt canonicalization rules: YAML rule files that make prompts start the same way.

This package knows nothing of HTTP and nothing of ``engine``.
"""
