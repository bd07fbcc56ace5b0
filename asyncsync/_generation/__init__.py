"""Token-in-token-out on one server: the generation engine and streams."""
