"""Model files (one per architecture family), shared layers, and the forward contract."""
