"""Helpers shared by every part of ucm: logging, config parsing."""
