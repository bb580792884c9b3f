"""Shared by servers and clients: error classes, the wire format, the input checks, layer routing,
the retry rule and the rank actors' names."""
