"""Scripts: probes, demos, generators (gen_env_example.py), the fuzzer's long run, the real-client
checks and their shared helpers (probelib, _probe_common, real_clients), which benchmarks/ imports
too. Run each by path (``.venv/bin/python scripts/probe_session.py``). A package only so that tests
can import ``scripts.probelib`` ahead of any other top-level ``scripts`` on the path."""
