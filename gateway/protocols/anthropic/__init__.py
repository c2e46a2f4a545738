"""The Anthropic Messages protocol (https://docs.anthropic.com/en/api/messages); notes in
docs/protocols.md."""
