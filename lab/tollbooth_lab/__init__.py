"""Tollbooth's lab: the simulated engine, the bench harness and the demo. Never part of the
production install: `pip install ./lab` (or `make demo`) brings it and its plotting libraries."""
