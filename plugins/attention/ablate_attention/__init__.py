"""Attention that does not materialise the scores matrix in Python: SDPA and Triton FlashAttention."""
