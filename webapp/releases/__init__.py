"""Agent releases (signed wheels) and their rollouts across the fleet."""
