"""Model artifacts: GGUF manifest, torrent pieces, HTTP and swarm fetch, tensor reads, packaged models."""
