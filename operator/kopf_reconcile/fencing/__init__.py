"""Epoch-fenced writes: the protocol, the sealed writer, and the PostgreSQL adapter."""
