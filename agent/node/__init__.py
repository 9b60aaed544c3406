"""The node runtime: data plane, session registry and KV accounting, control-channel client, config, enrollment."""
