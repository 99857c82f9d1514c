"""Process plumbing every side shares: logging, stopping tasks and child processes, test faults.

Nothing here knows about the broker, the weight format or either side of the request path.
"""
