"""One connection, stage by stage: unwrap the PROXY header, TLS handshake, then
tcp, udp or http (docs/architecture.md).
"""
