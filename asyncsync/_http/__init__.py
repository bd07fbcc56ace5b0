"""Sending: the one aiohttp transport (sessions, endpoints, deadlines, the error
mapping) and the retry rules."""
