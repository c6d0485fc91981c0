"""HTTP mode on the reactor: the HTTP/1.1 and HTTP/2 client sides on one
connection base and one upstream attempt.
"""
