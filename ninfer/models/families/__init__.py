"""One module per architecture family: its config quirks, checkpoint rules and sampling presets."""
