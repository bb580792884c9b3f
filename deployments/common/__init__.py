"""Shared by servers and clients: error classes, the wire format, layer routing and the retry rule."""
