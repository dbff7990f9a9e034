"""The Anthropic Messages front (``messages``: ``/v1/messages`` and ``/v1/messages/count_tokens``)."""
