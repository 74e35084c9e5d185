"""OpenAI Chat Completions: request rules, messages, wire shapes and the route."""
