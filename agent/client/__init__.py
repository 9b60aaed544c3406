"""The route client (drives a session over its hops) and the chat tokenizer."""
