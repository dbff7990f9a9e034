"""The HTTP machinery every front runs on: the pooled socket server and its deadlines
(``pooled_server``), the request handler that routes, reads bodies and answers errors
(``handler``), who may talk to the server (``guard``), the HTTP error every layer raises
(``errors``: status, headers, OpenAI's body) and server-sent-event frames (``sse``).
Imports nothing else of server/."""
