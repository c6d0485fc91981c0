"""Backends: server lists, health checks, discovery, held upstream connections,
and the start-up checks of what a backend needs.
"""
