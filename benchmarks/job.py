"""The no-op job every contender runs: its type and its payload."""

import json

JOB_TYPE = "noop"
PAYLOAD = {"n": 1}
#: The payload as JSON text, as the library stores it.
PAYLOAD_TEXT = json.dumps(PAYLOAD, separators=(",", ":"))
