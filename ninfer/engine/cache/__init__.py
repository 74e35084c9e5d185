"""The context cache: checkpoints a later request resumes from, their host tiers, and the planner
that decides what pressure takes (design: context-cache.md)."""
