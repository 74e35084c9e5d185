"""Project helpers for tests and local runs (tiny random artifacts with the real tokenizer)."""
