"""What the fronts share: the one seam to the engine (``job_adapter``), request validation and
structured output (``validation``, ``structured``), remote images (``image_fetch``), a reply's
usage, finish reason, parts and cache diagnoses in each front's words (``usage``, ``finish``,
``items``, ``cache_diagnostics``, ``error_shapes``), the pieces of a translated chat body
(``chat_body``, ``opaque``), and what the App installs at load (``warm_prompts``, ``features``)."""
