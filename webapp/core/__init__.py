"""Shared plumbing of the control plane: auth helpers, channel-layer helpers, the route-token key, the admin HTTP client."""
