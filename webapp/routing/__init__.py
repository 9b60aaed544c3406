"""Routing: choosing chains of ready shards, route sessions and route tokens."""
