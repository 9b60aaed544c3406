"""Fleet: nodes, enrollment, credentials and tracker passkeys, the agent websocket, placement of shards."""
