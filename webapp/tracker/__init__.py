"""BitTorrent tracker and HTTP web seed for model artifacts (pure logic; views are wired separately)."""
