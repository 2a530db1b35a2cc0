"""The bridge's root: it reads the environment once, when first imported, as the real one does."""

import json
import os

IMPORT_ENVIRONMENT = {k: v for k, v in os.environ.items() if k.startswith(("PT_HPU_", "PT_ENABLE_", "HCL_"))}
LAZY = IMPORT_ENVIRONMENT.get("PT_HPU_LAZY_MODE") == "1"

# A subprocess test names a file here to learn what the bridge saw at import.
if os.environ.get("HPU_STAND_IN_RECORD"):
    with open(os.environ["HPU_STAND_IN_RECORD"], "w") as record:
        json.dump(IMPORT_ENVIRONMENT, record)

from . import core, hpu  # noqa: E402,F401
