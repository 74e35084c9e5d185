"""The chat page at `/`: static files shipped in this package (no build step) and the route that serves them."""
