"""Shared code for the probe and benchmark scripts: HTTP client, request shapes, server
processes, replays and tables. The scripts import it through ``_probe_common``."""
