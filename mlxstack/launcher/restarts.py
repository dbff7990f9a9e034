"""When to restart a crashed MLX server: exponential backoff under a crash-loop limit (pure).

    policy = RestartPolicy(max_restarts=5, window=600.0)
    delay = policy.next_delay(now)   # seconds to wait before restart n, or None: give up

Restart k (counting those inside the window) waits ``base * 2**(k-1)`` seconds, capped at
``cap``: a server killed once by the OOM killer comes back in a second, one that dies on every
start stops costing CPU quickly. More than ``max_restarts`` within ``window`` seconds is a crash
loop: the launcher stops the stack and says so, rather than hiding the cause in endless output.
"""
from __future__ import annotations

from collections import deque


class RestartPolicy:
    def __init__(self, max_restarts: int, window: float, base: float = 1.0, cap: float = 30.0) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self.base = base
        self.cap = cap
        self.history: deque[float] = deque()

    def recent(self, now: float) -> int:
        while self.history and now - self.history[0] > self.window:
            self.history.popleft()
        return len(self.history)

    def next_delay(self, now: float) -> float | None:
        """Record a restart at ``now`` and return its delay, or None when the limit is reached."""
        count = self.recent(now)
        if count >= self.max_restarts:
            return None
        self.history.append(now)
        return min(self.cap, self.base * 2 ** count)
