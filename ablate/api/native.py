"""ablate's native CPU kernels, for plugins (ablate/model/native/, compiled on first use where the
machine has a C compiler):

    from ablate.api.native import paged_decode_attention, paged_decode_problem, available

paged_decode_problem(q, k_cache, v_cache) says why the kernel cannot take a step (None: it can);
paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, threads) -> (B, H, D).
"""
from ablate.model.native import available, paged_decode_attention, paged_decode_problem, unavailable_reason

__all__ = ["available", "paged_decode_attention", "paged_decode_problem", "unavailable_reason"]
