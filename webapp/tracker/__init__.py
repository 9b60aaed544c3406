"""Distributing artifacts to nodes: the manifest, .torrent and HTTP range endpoints, the BitTorrent tracker and the BEP 19 web seed."""
