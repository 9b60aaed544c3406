"""Fleet: nodes, enrollment, credentials, the agent websocket, placement of shards."""
