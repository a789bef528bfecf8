"""`python -m mg_server ...` runs `python -m mg_server.launch.cli ...`.

SGLang starts its scheduler with multiprocessing's spawn method, whose children re-import the
parent's main module, except when it is a package's `__main__` (CPython skips those). mg's
compatibility fixes are applied by that re-import of `mg_server.launch.cli`, so the entry module
must be `mg_server.launch.cli` itself (as it is for the `mg-server` console script, whose file is
re-run).
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "mg_server.launch.cli", *sys.argv[1:]])
