"""KV caches: contiguous and dynamic keep each sequence in one row (slot) of a dense buffer; paged keeps
it in fixed-size blocks of a shared pool, claimed as it grows (block_manager.py decides which)."""
