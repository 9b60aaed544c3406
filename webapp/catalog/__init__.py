"""Model catalog: registered GGUF artifacts, their manifests and the HTTP range endpoint agents fetch from."""
