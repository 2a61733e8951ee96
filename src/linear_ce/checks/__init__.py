"""Argument checking and shape normalisation shared by every entry point."""
