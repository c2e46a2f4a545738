"""The OpenAI Chat Completions and Completions protocols (https://platform.openai.com/docs/api-reference)."""
