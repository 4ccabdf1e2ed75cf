"""The limits a request is checked against, written once: main's engine (which every front door
submits through) and the HTTP door's request bodies both read them.
"""

from __future__ import annotations

MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's limit)
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
