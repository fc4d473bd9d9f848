"""The Llama-family decoder and its named shapes."""
