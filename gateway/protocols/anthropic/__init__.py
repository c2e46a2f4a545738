"""protocols/anthropic"""
