"""Foundations every layer names: the exception tree, shared types, a server's state,
deadlines, the event loop, completions, metrics hooks, JSON and the portal thread.
Imports nothing above itself."""
