"""Model catalog: registered GGUF artifacts, their manifests and .torrents."""
