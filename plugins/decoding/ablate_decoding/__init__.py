"""Decoding techniques: speculative decoding (draft k tokens, verify them in one target pass)."""
