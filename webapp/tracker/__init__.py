"""BitTorrent HTTP tracker and BEP 19 web seed for model artifacts (pure logic, store, views)."""
