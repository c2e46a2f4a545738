"""protocols/openai"""
