"""Zeroing before reuse: the erase itself, its queue, the scrub of dirty regions, and
the ledger of which free space is known to read as zeros.

Why together: memory is zeroed before anyone else can read it, and these four modules
are the whole of that promise.
"""
