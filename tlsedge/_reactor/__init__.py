"""The reactor (one epoll loop under trio), the streams it drives, the relay,
listening sockets and graceful drain.
"""
