"""Offline tools behind the `pagedweight` command: make-tiny, convert, calibrate, top (and the demo)."""
