"""Helpers of bench/peer.py (a package, so `make bench`'s bench/*.py loop skips them)."""
