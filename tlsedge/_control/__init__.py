"""The control plane: the edge's lifecycle, the command line, workers, reloads,
the admin endpoint, the status page, logging.
"""
