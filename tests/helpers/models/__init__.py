"""Tiny random-weight checkpoints for the tests, each saved as a real folder or file."""
