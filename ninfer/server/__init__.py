"""HTTP server: routes, protocol adapters, SSE, errors, request logging."""
