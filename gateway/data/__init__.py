"""Data files shipped with the gateway (the provider price table)."""
