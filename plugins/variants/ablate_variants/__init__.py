"""Model variants that shrink what attention caches: fewer K/V heads (GQA, MQA) and latent KV (MLA)."""
