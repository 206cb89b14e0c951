"""Ahead-of-time compiler (host side)."""
