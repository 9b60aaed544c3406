"""Routing: choosing chains of ready shards, route sessions and their route tokens."""
