"""`python -m hybridrl.model_merger merge|test ...`: veRL's model-merger command.

The code lives in `hybridrl.trainer.offline.model_merger`; this module keeps the short command.
"""

from __future__ import annotations

import sys

from hybridrl.trainer.offline.model_merger import main

if __name__ == "__main__":
    sys.exit(main())
