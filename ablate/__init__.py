"""ablate: measure what each LLM-inference technique buys, alone and in combination."""
