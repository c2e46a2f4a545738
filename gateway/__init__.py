"""prefixgate's HTTP face: OpenAI and Anthropic protocols, config, routing, stats, CLI."""
