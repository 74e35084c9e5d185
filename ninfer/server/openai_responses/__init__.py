"""OpenAI Responses Core: request rules, input Items, Item history, output Items and SSE, the local store."""
