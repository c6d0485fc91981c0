"""Records, policies and counters every layer above uses: configuration,
endings, the connection record and its access-log line, admission, forwarding,
balancing, metrics. No sockets.
"""
