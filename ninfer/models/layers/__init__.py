"""Shared building blocks of the model files (plain nn.Modules, checkpoint-compatible names)."""
