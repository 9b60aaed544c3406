"""Shared plumbing of the control plane: auth helpers, channel-layer helpers, management commands."""
