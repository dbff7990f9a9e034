"""Exit statuses of ``python -m mlxstack.serve`` that the launcher acts on (stdlib only).

A crash (killed by a signal, an unexpected exception) may be restarted; these two may not:
restarting cannot fix a bad configuration or a model that does not load, and a restart loop
would bury the first, useful error.
"""
EXIT_CONFIG_ERROR = 2        # bad setting, port unusable, exposed bind without MLX_API_KEY
EXIT_MODEL_LOAD_FAILED = 3   # the model could not be loaded; the error is the last "MODEL LOAD FAILED:" line

NOT_RESTARTABLE = frozenset({EXIT_CONFIG_ERROR, EXIT_MODEL_LOAD_FAILED})
LOAD_FAILED_MARKER = "MODEL LOAD FAILED:"
