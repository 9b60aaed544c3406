"""Template filters of the fleet pages."""
