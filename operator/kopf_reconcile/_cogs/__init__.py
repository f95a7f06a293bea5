"""Internal building blocks shared by several adapters; not part of the public API."""
