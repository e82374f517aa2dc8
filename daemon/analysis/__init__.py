"""Offline analysis of a finished run: what the trainer did, read from its logs and the
daemon's events (:mod:`.summary`). Nothing here runs in the live loop."""
