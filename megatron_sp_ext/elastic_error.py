"""Tell torchrun why a rank stopped: our one-line message as the root cause of its failure report.

torch.distributed.elastic gives each child the path of an error file in ``TORCHELASTIC_ERROR_FILE`` and, when a
child fails, prints that file's message under "Root Cause" at the bottom of its report. Its own ``@record`` writes
the Python traceback there; for a user's error (a flag, a JSON key) we write the one message that names the setting.
"""
from __future__ import annotations

import json
import os
import time

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def record_user_error(message: str) -> bool:
    """Write ``message`` (one line, no traceback) as this process's error for torchrun's report.
    Returns False (and writes nothing) when not run under torchrun or the file cannot be written."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True
