"""The plan: every tensor's scheme, each linear's weight source, the bytes and the peak memory."""
