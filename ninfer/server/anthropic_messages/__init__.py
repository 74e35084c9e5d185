"""Anthropic Messages: request rules, block lowering, content blocks and SSE, and the routes."""
