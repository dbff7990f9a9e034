"""Which content parts a chat message may carry, and the words for one it may not (pure): the MLX
server's validation (server/common/validation.py) and the front door of 4000 (routing/front_door.py) answer
an unknown part type alike, with 400 naming ``messages[i].content[j].type``."""
from __future__ import annotations

from .images import IMAGE_PART_TYPES

__all__ = ["TEXT_PART_TYPES", "IMAGE_PART_TYPES", "unsupported_part"]

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def unsupported_part(at: str, shown: str) -> str:
    """The 400's message for the part at ``at`` whose type reads ``shown``."""
    return (f"{at}.type {shown} is not supported: send text parts ({', '.join(sorted(TEXT_PART_TYPES))}) "
            f"or images ({', '.join(sorted(IMAGE_PART_TYPES))}); audio and file parts are not accepted")
