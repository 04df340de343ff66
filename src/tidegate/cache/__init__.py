"""Response caches: keys, entries and indexes (pure); the gateway drives them."""
