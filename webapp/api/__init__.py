"""The OpenAI-compatible API (/v1/...) and the per-user API keys it authenticates with."""
