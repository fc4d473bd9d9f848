"""Helpers for testing ablate and third-party plugins against it."""
