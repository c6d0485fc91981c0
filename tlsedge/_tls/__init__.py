"""TLS: contexts and certificates, the ClientHello check, the TLS stream and
the socket I/O under its async API.
"""
