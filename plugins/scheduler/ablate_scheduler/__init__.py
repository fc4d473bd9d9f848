"""Schedulers for ablate: which sequences run each step, and how many tokens each feeds."""
