"""http: the Starlette app: the route table, one route module per face (OpenAI, Anthropic, count tokens,
admin), body reading, request context, and the one exception handler.
"""
