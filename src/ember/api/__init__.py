"""The HTTP edge: OpenAI/vLLM-compatible schemas, routes, error mapping, metrics (no torch)."""
