"""The OpenAI fronts: chat completions (``chat``: the request; ``chat_reply``: chat.completion
bodies and chunk frames) and the Responses API (``responses``: the front and its output items;
``responses_to_chat``: a request -> the chat-completions body it means; ``response_store``: the
conversations ``previous_response_id`` names)."""
