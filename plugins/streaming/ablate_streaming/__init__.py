"""ablate-streaming: StreamingLLM's KV cache (attention sinks + a sliding window) as an ablate plugin."""
