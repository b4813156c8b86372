"""Speculative decoding: draft several tokens cheaply, verify them in one target forward.

``base`` holds the drafter interface and the per-request statistics, ``rollback`` moves KV
caches back to the accepted length, ``verify`` is the decode loop shared by every method,
and ``lookup`` / ``draft_model`` / ``mtp`` are the methods a profile's ``speculation.mode``
selects.
"""
