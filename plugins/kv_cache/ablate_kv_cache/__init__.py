"""KV caches that keep every sequence's keys and values in one row (slot) of a dense buffer."""
